"""The workload: which model gets which prompt when, fixed by a seed.

Each model alternates a busy period (Poisson arrivals at ``busy_rate``) and an
idle one (``idle_rate``, 0 by default), with the same cycle ``period_s`` for
all models but offset by ``period_s / models``: with three models, a 90 s
cycle and 40 s busy periods, at most two models are busy at once, and for
most of the time one. Every prompt is one of ``families`` long prefixes of its
model followed by a request's own suffix, so a prefix cache that survives an
idle period serves the next burst. Prompts are token ids (no tokenizer is
needed, the servers run dummy weights), derived from string seeds so every
process, on every machine, builds the same ones.

The schedule is a pure function of :class:`Workload`; :func:`digest` names it,
so two result files can be checked to come from the same prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Iterator

#: Token ids the shipped byte-level tokenizer knows (it has ~480 plus bos/eos): any id below the
#: model's vocabulary is valid, these also decode to text in a log.
TOKEN_LOW, TOKEN_HIGH = 10, 460
#: KV bytes per token of a Llama-3.1-8B (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes).
LLAMA_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


class WorkloadError(ValueError):
    """A workload parameter that cannot describe a schedule."""


@dataclass(frozen=True)
class Workload:
    """Everything that decides the schedule and the prompts."""

    models: tuple[str, ...] = ("model-a", "model-b", "model-c")
    seed: int = 20
    duration_s: float = 180.0
    period_s: float = 90.0
    busy_s: float = 40.0
    busy_rate: float = 8.0
    idle_rate: float = 0.0
    families: int = 8
    prefix_tokens: int = 3072
    suffix_min: int = 256
    suffix_max: int = 768
    output_tokens: int = 192
    probes: int = 4

    def __post_init__(self) -> None:
        problems = [name for name, bad in (
            ("models (at least one, names unique)", not self.models or len(set(self.models)) != len(self.models)),
            ("duration_s > 0", not self.duration_s > 0), ("period_s > 0", not self.period_s > 0),
            ("0 < busy_s <= period_s", not 0 < self.busy_s <= self.period_s),
            ("duration_s > the last model's offset (period_s x (models - 1) / models): every model busy once",
             bool(self.models) and self.duration_s <= self.offset(len(self.models) - 1)),
            ("busy_rate > 0", not self.busy_rate > 0), ("idle_rate >= 0", not self.idle_rate >= 0),
            ("families >= 1", self.families < 1), ("prefix_tokens >= 0", self.prefix_tokens < 0),
            ("1 <= suffix_min <= suffix_max", not 1 <= self.suffix_min <= self.suffix_max),
            ("output_tokens >= 1", self.output_tokens < 1), ("probes >= 0", self.probes < 0))
            if bad]
        if problems:
            raise WorkloadError(f"workload needs {', '.join(problems)}; got {self}")

    def offset(self, model: int) -> float:
        """When model ``model``'s first busy period starts."""
        return model * self.period_s / len(self.models)

    def busy_windows(self, model: int) -> list[tuple[float, float]]:
        """The busy periods of model ``model`` inside [0, duration_s), as (start, end) seconds."""
        windows, start = [], self.offset(model)
        while start < self.duration_s:
            windows.append((start, min(start + self.busy_s, self.duration_s)))
            start += self.period_s
        return windows

    def is_busy(self, model: int, t: float) -> bool:
        return any(start <= t < end for start, end in self.busy_windows(model))


@dataclass(frozen=True)
class Request:
    """One request of the schedule; ``send_s`` is None for a probe (sent after the load, one at a time)."""

    index: int
    model: str
    send_s: float | None
    family: int
    suffix_len: int
    max_tokens: int

    @property
    def probe(self) -> bool:
        return self.send_s is None


def _rng(*parts: object) -> random.Random:
    """A generator seeded by a string: identical in every process (``hash()`` is not)."""
    return random.Random("/".join(str(p) for p in parts))


def _arrivals(w: Workload, m: int) -> Iterator[float]:
    """Poisson arrivals of model ``m`` with the piecewise rate of its busy and idle periods (thinning)."""
    rng, top, t = _rng(w.seed, "arrivals", w.models[m]), max(w.busy_rate, w.idle_rate), 0.0
    while True:
        t += rng.expovariate(top)
        if t >= w.duration_s:
            return
        rate = w.busy_rate if w.is_busy(m, t) else w.idle_rate
        if rng.random() * top < rate:
            yield t


def schedule(w: Workload) -> list[Request]:
    """The timed requests of all models in send order, then ``probes`` probes per model."""
    timed: list[tuple[float, int, int, int]] = []
    for m, model in enumerate(w.models):
        shape = _rng(w.seed, "shape", model)
        for t in _arrivals(w, m):
            timed.append((t, m, shape.randrange(w.families), shape.randint(w.suffix_min, w.suffix_max)))
    timed.sort()
    requests = [Request(i, w.models[m], round(t, 6), family, length, w.output_tokens)
                for i, (t, m, family, length) in enumerate(timed)]
    for m, model in enumerate(w.models):
        shape = _rng(w.seed, "probe", model)
        for p in range(w.probes):
            requests.append(Request(len(requests), model, None, p % w.families,
                                    shape.randint(w.suffix_min, w.suffix_max), w.output_tokens))
    return requests


def prompt_ids(w: Workload, request: Request) -> list[int]:
    """The prompt's token ids: its model's family prefix, then its own suffix."""
    prefix = _rng(w.seed, "prefix", request.model, request.family)
    suffix = _rng(w.seed, "suffix", request.index)
    return ([prefix.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(w.prefix_tokens)]
            + [suffix.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(request.suffix_len)])


def digest(requests: list[Request]) -> str:
    """A short name of the schedule: equal digests mean the same prompts in the same order."""
    text = json.dumps([dataclasses.astuple(r) for r in requests])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def max_busy_at_once(w: Workload) -> int:
    """The largest number of models busy at the same moment."""
    # (time, -1) sorts before (time, +1): a window ending when another starts does not overlap it
    edges = sorted((t, +1 if kind == 0 else -1) for m in range(len(w.models))
                   for window in w.busy_windows(m) for kind, t in enumerate(window))
    busy = peak = 0
    for _, step in edges:
        busy += step
        peak = max(peak, busy)
    return peak


def describe(w: Workload, requests: list[Request], kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN) -> str:
    """The schedule as text: a timeline per model ('#' busy), counts and the offered load."""
    step_s = w.period_s / 18
    cells = math.ceil(w.duration_s / step_s)
    lines = [f"workload {digest(requests)}: seed {w.seed}, {w.duration_s:g} s, cycle {w.period_s:g} s, "
             f"busy {w.busy_s:g} s at {w.busy_rate:g} req/s (idle {w.idle_rate:g} req/s), "
             f"at most {max_busy_at_once(w)} model(s) busy at once",
             f"prompts: {w.families} prefixes of {w.prefix_tokens} tokens per model "
             f"({w.families * w.prefix_tokens * kv_bytes_per_token / 2**30:.2f} GiB of KV at "
             f"{kv_bytes_per_token} B/token) + a suffix of {w.suffix_min}-{w.suffix_max}; "
             f"{w.output_tokens} output tokens (ignore_eos); {w.probes} probe(s) per model after the load",
             f"timeline, one cell per {step_s:g} s ('#' busy):"]
    for m, model in enumerate(w.models):
        timeline = "".join("#" if w.is_busy(m, (c + 0.5) * step_s) else "." for c in range(cells))
        mine = [r for r in requests if r.model == model and not r.probe]
        busy_time = sum(end - start for start, end in w.busy_windows(m))
        own = sum(r.suffix_len for r in mine)
        windows = ", ".join(f"{a:g}-{b:g}" for a, b in w.busy_windows(m))
        lines.append(f"  {model:<12} {timeline}  {len(mine)} requests; busy {windows} s; "
                     f"{(own + len(mine) * w.prefix_tokens) / busy_time:,.0f} prompt tok/s "
                     f"({own / busy_time:,.0f} beyond the prefixes), "
                     f"{len(mine) * w.output_tokens / busy_time:,.0f} output tok/s while busy")
    return "\n".join(lines)
