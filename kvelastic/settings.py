"""kvelastic's settings, read once from ``KVELASTIC_*`` environment variables.

Every variable is validated here, and a bad value stops start-up with a
message that names the variable and the accepted form, before vLLM is touched.
A ``KVELASTIC_*`` name that no part of kvelastic reads is most likely a typo
(``KVELASTIC_LIMT``) that would silently mean "default", so
:func:`unknown_variables` names it with the nearest real name.
"""

from __future__ import annotations

import difflib
import grp
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Mapping

from kvelastic import switch
from kvelastic.errors import ConfigError
from kvelastic.units import format_size, parse_size

MIB = 1024 * 1024
CHUNK_GRANULE = 2 * MIB  # the CUDA allocation granularity: every chunk is a multiple of it
PREFIX = "KVELASTIC_"
#: ``KVELASTIC_*`` variables read outside :class:`Settings` (launcher, tests, CI).
OTHER_VARIABLES = ("KVELASTIC_LAUNCH_NO_GPU", "KVELASTIC_VLLM_SRC_CACHE",
                   "KVELASTIC_REQUIRE_VLLM", "KVELASTIC_DROP_VENVS", "KVELASTIC_BAND_A", "KVELASTIC_VENV",
                   "KVELASTIC_VENV_BAND_A", "KVELASTIC_BAND_C", "KVELASTIC_VENV_BAND_C")
_ASCII_DIGITS = re.compile(r"[0-9]+")


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds (for example 10 or 0.5)") from None
    if value < 0 or value != value:
        raise ConfigError(f"{name}={text!r} must be a non-negative number of seconds")
    return value


def _switch_interval(name: str, text: str) -> float | None:
    if text.strip().lower() == "none":
        return None  # leave Python's own (0.005 s unless the application changed it)
    value = _seconds(name, text)
    if not 0 < value <= 1:
        raise ConfigError(f"{name}={text!r} must be above 0 and at most 1 second (for example 0.0002), "
                          f"or none to keep Python's own (0.005)")
    return value


def _chunk(name: str, text: str) -> int:
    value = parse_size(text, name=name)
    if value <= 0 or value % (2 * MIB):
        raise ConfigError(f"{name}={text!r} must be a positive multiple of 2MiB (for example 2MiB, 8MiB, 32MiB)")
    return value


def _size(name: str, text: str) -> int:
    value = parse_size(text, name=name)
    if value <= 0:
        raise ConfigError(f"{name}={text!r} must be larger than zero")
    return value


def _port(name: str, text: str) -> int:
    # Not str.isdigit(): it accepts '²' and other digits int() refuses or reads differently.
    value = text.strip()
    if not _ASCII_DIGITS.fullmatch(value) or not 0 < int(value) < 65536:
        raise ConfigError(f"{name}={text!r} is not a TCP port: expected a number from 1 to 65535")
    return int(value)


def _choice(*options: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ConfigError(f"{name}={text!r} is not one of: {', '.join(options)}")
        return value

    return parse


def _shared_dir(name: str, text: str) -> str:
    """An existing directory named by an absolute path: a relative one would resolve per working directory."""
    value = text.strip()
    if not os.path.isabs(value):
        raise ConfigError(f"{name}={text!r} must be an absolute path (for example /dev/shm): a relative "
                          f"one would mean another directory for every working directory")
    if not os.path.isdir(value):
        raise ConfigError(f"{name}={text!r} is not an existing directory; kvelastic creates only its own "
                          f"folder inside it (for example /dev/shm)")
    return os.path.normpath(value)


def _group(name: str, text: str) -> int:
    """A group this process belongs to, by name or number: its members share one account per GPU."""
    value = text.strip()
    try:
        gid = int(value) if value.isdigit() else grp.getgrnam(value).gr_gid
    except KeyError:
        raise ConfigError(f"{name}={text!r} is not a group on this machine") from None
    if gid not in os.getgroups() and gid != os.getegid():
        raise ConfigError(f"{name}={text!r}: this process (uid {os.geteuid()}) is not a member of group {gid}; "
                          f"only members may share its accounts")
    return gid


def _name(name: str, text: str) -> str:
    value = text.strip()
    if not value or not all(c.isalnum() or c in "-_." for c in value) or len(value) > 64:
        raise ConfigError(f"{name}={text!r} must be 1-64 characters of letters, digits, '-', '_' or '.'")
    return value


@dataclass(frozen=True)
class Settings:
    """Validated settings. Field metadata names the environment variable of each."""

    enabled: bool = False
    strict: bool = True
    chunk_bytes: int = 8 * MIB  # chosen from vLLM throughput on the GPU: docs/chunk-size.md
    virtual_bytes: int | None = None
    limit_bytes: int | None = None
    reserve_bytes: int = 256 * MIB
    #: Most bytes the warm reserve grows to, while busy and nobody else waits, to cover the longest host-tier
    #: run reloaded in the last minute (0: off). On an H100 it took a busy engine's 16k-token 8B reload from
    #: 84 to 64 ms (docs/offload.md, item 6).
    reserve_host_runs_bytes: int = 2048 * MIB
    #: Most bytes the warm reserve grows by per upkeep tick (four a second) while requests run; between
    #: requests it grows at once. On an H200 (session 25) 2 GiB grown at once beside the request after a
    #: 16k-token reload cost that request 15-40 ms in a third of the reps; 256 MiB a tick, none.
    reserve_busy_step_bytes: int = 256 * MIB
    prefetch_bytes: int = 1024 * MIB
    cache_ttl_s: float = 10.0
    #: Python's thread switch interval in the processes that hold a KV pool (None: Python's own, 5 ms).
    #: Their mapper and upkeep threads make runs of driver calls, each of which must win the GIL back from
    #: vLLM's busy loop; CPython hands it over after at most this long. On an H200 (session 27,
    #: docs/pool.md) a 32-tensor group map beside a Python-busy thread took 326 ms at 5 ms, 64 at 1 ms and
    #: 14 at 0.2 ms (1.0 alone), and an idle engine's 16k-token 8B reload 80.9 ms, 68.8 and 64.6.
    switch_interval_s: float | None = 0.0002
    cpu_bytes: int | None = None
    cpu_policy: str = "arc"
    #: ``auto``: the copy engines for runs of blocks where a block's pieces are 32 KiB or wider, the direct
    #: kernels otherwise (copier.RUNS_MIN_PIECE_BYTES; bench_copy.py and bench_reload.py on an H100, 2026-11-28)
    copy_path: str = "auto"
    #: How the host tier's memory is pinned: ``background`` (one mmap registered chunk by chunk while the
    #: engine serves) or ``at-start`` (one torch pinned allocation before it serves, as before 2026-11-26):
    #: the multi-turn A/B of 2026-11-27 found the tier 9 % slower than a tree that used torch's allocation.
    cpu_pin: str = "background"
    #: When blocks are copied to the host: once computed, beside the forward passes (``write-through``), or as
    #: they leave the GPU, in front of the step that reuses them (``eviction``; docs/offload.md); ``auto``:
    #: ``write-through`` where the KV cache is in the engine's process (its stores then get a stream and a
    #: staging buffer of their own, below), ``eviction`` where worker ranks hold it (tensor or pipeline
    #: parallelism, the multiprocess executor: their stores would share the ranks' copy stream, never run
    #: on a GPU). ``auto`` since the H200 calls of 2026-11-28
    #: (8B multi-turn, two calls): TTFT p50 0.87x and 0.97x the OffloadingConnector with LRU, throughput
    #: 1.005x and 1.012x, where ``eviction`` had 1.31x (the spills of the blocks a turn's loads go into).
    cpu_store: str = "auto"
    cpu_ahead_bytes: int | None = None  # write-through's share of the tier; None: a quarter of it
    cpu_store_step_bytes: int = 512 * MIB  # write-through bytes issued per scheduling step, at most
    #: Where write-through's stores run: on the one copy stream, ahead of the next step's loads (``shared``),
    #: or on a stream of their own (``own``), the loads waiting only for a store they would race. ``own``:
    #: token-identical in every GPU run (H200, 2026-11-28), and with ``staged`` (below) the 8B shape's best.
    cpu_store_stream: str = "own"
    #: How the stores on their own stream (``own``) move: as the other copies (``same``: with ``auto``, SM
    #: kernels wherever blocks are scattered) or through a staging buffer of their own onto the copy engines
    #: (``staged``: their SMs only gather at device-memory speed). ``staged``: on an H200 (2026-11-28,
    #: scripts/bench_copy_beside.py) stores of 8B-shaped blocks beside a compute loop slowed it 4.4 % on the
    #: direct kernels, 48 % on the fused one, 0 % staged; multi-turn 8B 1.005x the connector staged, 0.965x not.
    cpu_store_path: str = "staged"
    #: How host-tier hits load: ``sync`` in front of the step's forward pass (every request of the step
    #: waits), ``async`` while their request waits and the others compute (docs/offload-async-loads.md), or
    #: ``auto``: ``async`` wherever the loads can finish beside compute (the cache in the engine's process, or
    #: ranks that report on the steps' replies), else ``sync``, said in the log. ``auto`` since the H200 calls
    #: of 2026-11-28: on the 1B multi-turn ``async`` led ``sync`` (1.09x against 1.04x the connector, the one
    #: call that ran both), and on the 8B its TTFT p50 was 1.18x the connector's against 1.31x. Under ``auto``
    #: a request alone in an idle engine loads in front of the step (``hooks/host_loads.InFrontWhenAlone``):
    #: a 16k-token 8B reload took 105 ms beside compute, 72 in front (H200, 2026-11-29).
    cpu_load: str = "auto"
    cpu_load_async_min_bytes: int = 0  # with ``async``: a smaller run loads in front of the step instead
    #: How the asynchronous loads move: as the other copies (``same``) or through a staging buffer of their
    #: own (``staged``: DMA on the copy engines, then a scatter at device-memory speed), as
    #: ``cpu_store_path`` does for the stores, and for the same reason: they too run beside compute.
    #: ``staged``: an 8B-shaped load beside the compute loop cost it 0.4 % staged, 40 % fused (H200, 2026-11-28).
    cpu_load_path: str = "staged"
    #: When a step's synchronous host loads go out: a page group's worth at a time as vLLM looks the blocks
    #: up, each copy beside the next group's mapping, within a run of host hits two groups long (``long-runs``)
    #: or any run (``group``); or all at the step's end (``off``). ``long-runs``: on an H100 (2026-11-27, two
    #: calls) ``group`` reloaded a 16k prefix in 103.4 / 109.6 ms against 115.3 / 112.6, and cost the 1B
    #: multi-turn 6 % (one run), whose runs are shorter than a group and keep one batch with ``long-runs``.
    cpu_load_pieces: str = "long-runs"
    name: str | None = None
    min_bytes: int = 0
    port: int = 0
    shared_budget_bytes: int | None = None
    shared_dir: str = "/dev/shm"
    shared_group: int | None = None  # gid whose members share accounts (unset: only this uid)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            variable, parse = _VARIABLES[field.name]
            text = env.get(variable)
            if text is not None and text.strip() != "":
                values[field.name] = parse(variable, text)
        settings = cls(**values)  # type: ignore[arg-type]
        _check_together(settings, env)
        return settings

    @staticmethod
    def variables() -> dict[str, str]:
        """Variable name -> field name, for documentation and the CLI."""
        return {variable: field for field, (variable, _) in _VARIABLES.items()}


def _check_together(settings: Settings, env: Mapping[str, str]) -> None:
    """Refuse sizes that are valid alone but cannot work with the chunk size (or each other)."""
    chunk = settings.chunk_bytes
    for field_name in ("limit_bytes", "virtual_bytes", "shared_budget_bytes"):
        value = getattr(settings, field_name)
        if value is not None and value < chunk:
            variable = _VARIABLES[field_name][0]
            raise ConfigError(f"{variable}={env.get(variable)!r} is smaller than one chunk "
                              f"({_chunk_text(chunk)}, KVELASTIC_CHUNK_SIZE): not even one page could be "
                              f"mapped; use at least {_chunk_text(chunk)}")
    if settings.limit_bytes is not None and settings.min_bytes > settings.limit_bytes:
        raise ConfigError(f"KVELASTIC_MIN={env.get('KVELASTIC_MIN')!r} is larger than "
                          f"KVELASTIC_LIMIT={env.get('KVELASTIC_LIMIT')!r}: a reservation must fit under the cap")


def _chunk_text(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB"


def known_variables() -> tuple[str, ...]:
    """Every ``KVELASTIC*`` variable some part of kvelastic reads."""
    return tuple(variable for variable, _ in _VARIABLES.values()) + OTHER_VARIABLES


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``KVELASTIC_*`` variable that nothing reads: what a retired one's job has become, else
    the nearest real name."""
    env = os.environ if environ is None else environ
    known = known_variables()
    suffixes = {v[len(PREFIX):]: v for v in known if v.startswith(PREFIX)}
    warnings = []
    for variable in sorted(v for v in env if v.startswith(PREFIX) and v not in known):
        if variable in RETIRED:
            warnings.append(f"{variable} is retired and ignored: {RETIRED[variable]}")
            continue
        nearest = difflib.get_close_matches(variable[len(PREFIX):], suffixes, n=1, cutoff=0.6)
        hint = f"did you mean {suffixes[nearest[0]]}?" if nearest else "settings: " + ", ".join(Settings.variables())
        warnings.append(f"{variable} is not a kvelastic setting and is ignored; {hint}")
    return warnings


def describe(settings: Settings, environ: Mapping[str, str] | None = None) -> str:
    """The settings in effect on one line, ``VARIABLE=value``; ``*`` marks those set in the environment."""
    env = os.environ if environ is None else environ
    parts = []
    for field in fields(Settings):
        variable, _ = _VARIABLES[field.name]
        if variable == "KVELASTIC":
            continue
        value = getattr(settings, field.name)
        if value is None or (field.name == "port" and not value):  # port 0: none given
            shown = "none"
        elif isinstance(value, bool):
            shown = "1" if value else "0"
        elif field.name.endswith("_bytes"):
            shown = format_size(value).replace(" ", "")
        else:
            shown = f"{value:g}" if isinstance(value, float) else str(value)
        mark = "*" if (env.get(variable) or "").strip() else ""
        parts.append(f"{variable}={shown}{mark}")
    return " ".join(parts)


_VARIABLES: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "enabled": (switch.VARIABLE, switch.parse),
    "strict": ("KVELASTIC_STRICT", switch.parse),
    "chunk_bytes": ("KVELASTIC_CHUNK_SIZE", _chunk),
    "virtual_bytes": ("KVELASTIC_VIRTUAL_BYTES", _size),
    "limit_bytes": ("KVELASTIC_LIMIT", _size),
    "reserve_bytes": ("KVELASTIC_RESERVE", lambda n, t: parse_size(t, name=n)),
    "reserve_host_runs_bytes": ("KVELASTIC_RESERVE_HOST_RUNS", lambda n, t: parse_size(t, name=n)),
    "reserve_busy_step_bytes": ("KVELASTIC_RESERVE_BUSY_STEP", _size),
    "prefetch_bytes": ("KVELASTIC_PREFETCH", lambda n, t: parse_size(t, name=n)),
    "cache_ttl_s": ("KVELASTIC_CACHE_TTL", _seconds),
    "switch_interval_s": ("KVELASTIC_SWITCH_INTERVAL", _switch_interval),
    "cpu_bytes": ("KVELASTIC_CPU_BYTES", _size),
    "cpu_policy": ("KVELASTIC_CPU_POLICY", _choice("arc", "lru")),
    "copy_path": ("KVELASTIC_COPY_PATH", _choice("auto", "direct", "staged", "fused", "runs")),
    "cpu_store": ("KVELASTIC_CPU_STORE", _choice("auto", "write-through", "eviction")),
    "cpu_pin": ("KVELASTIC_CPU_PIN", _choice("background", "at-start")),
    "cpu_ahead_bytes": ("KVELASTIC_CPU_AHEAD", _size),
    "cpu_store_step_bytes": ("KVELASTIC_CPU_STORE_STEP", _size),
    "cpu_store_stream": ("KVELASTIC_CPU_STORE_STREAM", _choice("shared", "own")),
    "cpu_store_path": ("KVELASTIC_CPU_STORE_PATH", _choice("same", "staged")),
    "cpu_load": ("KVELASTIC_CPU_LOAD", _choice("auto", "sync", "async")),
    "cpu_load_async_min_bytes": ("KVELASTIC_CPU_LOAD_ASYNC_MIN", lambda n, t: parse_size(t, name=n)),
    "cpu_load_path": ("KVELASTIC_CPU_LOAD_PATH", _choice("same", "staged")),
    "cpu_load_pieces": ("KVELASTIC_CPU_LOAD_PIECES", _choice("long-runs", "group", "off")),
    "name": ("KVELASTIC_NAME", _name),
    "min_bytes": ("KVELASTIC_MIN", lambda n, t: parse_size(t, name=n)),
    "port": ("KVELASTIC_PORT", lambda n, t: _port(n, t)),
    "shared_budget_bytes": ("KVELASTIC_SHARED_BUDGET", _size),
    "shared_dir": ("KVELASTIC_SHARED_DIR", _shared_dir),
    "shared_group": ("KVELASTIC_SHARED_GROUP", _group),
}


def shared_location(environ: Mapping[str, str] | None = None) -> tuple[Path, int | None]:
    """``(KVELASTIC_SHARED_DIR, KVELASTIC_SHARED_GROUP)``, validated, without reading any other variable.

    The CLI and the shared-file code need only these two; a bad value of an
    unrelated variable must not stop ``kvelastic status``.
    """
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for field in ("shared_dir", "shared_group"):
        variable, parse = _VARIABLES[field]
        text = env.get(variable)
        values[field] = parse(variable, text) if text is not None and text.strip() else None
    return Path(str(values["shared_dir"] or Settings.shared_dir)), values["shared_group"]  # type: ignore[return-value]


#: Variables kvelastic does not read that an older environment may still set, each with what kvelastic does
#: instead. Never an error: start-up names each one set, once (:func:`unknown_variables`).
RETIRED: dict[str, str] = {
    "KVELASTIC_RELEASE": "memory that running requests hold drains as they finish or as vLLM preempts its newest "
                         "(kvelastic preempts nothing itself)",
    "KVELASTIC_TP_CONFIRM": "worker ranks confirm their maps on their replies to the steps, which vLLM's "
                            "multiprocess and Ray V2 executors gather; other executors are refused at start-up",
    "KVELASTIC_TP_MAP_AFTER_LAUNCH": "a worker rank maps a step's page groups once the step's forward pass is "
                                     "launched",
    "KVELASTIC_PIPELINE": "pipeline parallelism runs wherever the executor is supported (each stage maps and "
                          "confirms its own layers' page groups)",
    "KVELASTIC_RAY": "Ray's V2 executor runs as vLLM's multiprocess executor does; Ray's v1 executor is refused at "
                     "start-up",
}
