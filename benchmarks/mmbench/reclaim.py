"""Reclaim latency of a run, from the engines' own clocks (kvelastic/scheduler/reclaim_timing.py).

Two engine-side sources, beside the account sampling of ``summary.reclaim_episodes`` (kept as a
cross-check on the client's clock):

- each server's ``/metrics``: the ``kvelastic_reclaim_wait_seconds`` histogram (a refused engine's
  wait, from the budget refusal that began it to the first grant after it) and
  ``kvelastic_reclaim_release_seconds`` (a giving engine's, from reading the want to the release
  that covered it), as their growth from the first to the last sample of the run. Percentiles are
  estimated from the buckets as Prometheus' ``histogram_quantile`` does (linear inside a bucket),
  so they are only as fine as the buckets; counts and means are exact.
- the servers' logs, where collected (``--server-logs``): one line per ended episode with its exact
  duration. The engines rate-limit these lines; the ones left out are counted, and the metrics
  count every episode.

What matters most is the reclaim latency of memory an *idle* model holds. A wait can also be for memory
busy engines hold (the fair-share cap makes them give it back as their requests finish), which is
bounded by request lifetimes, not by reclaim. :func:`wait_sources` tells the two apart with the
account sample taken just before each wait began: whether the budget's free room and the cached
memory idle engines could give (the policy's own ``reclaimable`` and ``uses_a_real_part``) covered
what the engine asked.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path
from typing import Any, Iterable

from kvelastic.cluster.policy import reclaimable, uses_a_real_part
from kvelastic.cluster.records import MemberRecord
from benchmarks.percentiles import percentile

WAIT, RELEASE = "kvelastic_reclaim_wait_seconds", "kvelastic_reclaim_release_seconds"
COUNTERS = {"lapsed_waits": "kvelastic_reclaim_lapsed_waits_total",
            "unserved_asks": "kvelastic_reclaim_unserved_asks_total",
            "released_bytes": "kvelastic_reclaim_released_bytes_total"}


# ------------------------------------------------------------------ /metrics histograms
def histogram(values: dict[str, float], name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of histogram ``name`` in one sample, by bound; [] if absent.

    ``sampling.metric_values`` keys each bucket ``NAME_bucket{le="BOUND"}``.
    """
    prefix = f'{name}_bucket{{le="'
    return sorted((float(key[len(prefix):-2]), count) for key, count in values.items() if key.startswith(prefix))


def growth(first: dict[str, float], last: dict[str, float], name: str) -> list[tuple[float, float]]:
    """How much each cumulative bucket of ``name`` grew from ``first`` to ``last``."""
    before = dict(histogram(first, name))
    return [(bound, count - before.get(bound, 0.0)) for bound, count in histogram(last, name)]


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile (0-1) of cumulative ``buckets``, interpolated as ``histogram_quantile`` does.

    In the last (+Inf) bucket the answer is the highest finite bound; None without observations.
    """
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return bound if count == below else lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return None


def _side(buckets: list[tuple[float, float]], count: float, total: float) -> dict[str, Any]:
    return {"count": round(count), "mean_s": total / count if count else None,
            "p50_s": bucket_quantile(buckets, 0.5), "p95_s": bucket_quantile(buckets, 0.95), "buckets": buckets}


def _merged(parts: Iterable[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    merged: dict[float, float] = {}
    for buckets in parts:
        for bound, count in buckets:
            merged[bound] = merged.get(bound, 0.0) + count
    return sorted(merged.items())


def engine_histograms(samples: list[dict[str, Any]], models: list[str]) -> dict[str, Any] | None:
    """Per model and overall: waits and releases from the histograms' growth, and the counters'.

    None when no server exports the histograms (vanilla vLLM, kvcached, or no account joined).
    """
    per: dict[str, dict[str, Any]] = {}
    for model in models:
        seen = [s["servers"][model] for s in samples if s["servers"].get(model) is not None]
        if not seen or f"{WAIT}_count" not in seen[-1]:
            continue
        first, last = seen[0], seen[-1]
        grew = {name: last.get(name, 0.0) - first.get(name, 0.0)
                for name in (f"{WAIT}_count", f"{WAIT}_sum", f"{RELEASE}_count", f"{RELEASE}_sum", *COUNTERS.values())}
        per[model] = {"waits": _side(growth(first, last, WAIT), grew[f"{WAIT}_count"], grew[f"{WAIT}_sum"]),
                      "releases": _side(growth(first, last, RELEASE), grew[f"{RELEASE}_count"],
                                        grew[f"{RELEASE}_sum"]),
                      **{key: grew[name] for key, name in COUNTERS.items()}}
    if not per:
        return None
    overall: dict[str, Any] = {key: sum(p[key] for p in per.values()) for key in COUNTERS}
    for side in ("waits", "releases"):
        count = sum(p[side]["count"] for p in per.values())
        total = sum((p[side]["mean_s"] or 0.0) * p[side]["count"] for p in per.values())
        overall[side] = _side(_merged(p[side]["buckets"] for p in per.values()), count, total)
    return {**per, "all": overall}


# ------------------------------------------------------------------ server logs
def read_logs(folder: str | Path) -> dict[str, Any]:
    """Every reclaim episode line in ``folder/*.log``, and how many lines the engines left out."""
    from dataclasses import asdict

    from kvelastic.scheduler.reclaim_timing import parse_left_out, parse_line

    episodes, left_out, files = [], 0, sorted(Path(folder).glob("*.log"))
    for path in files:
        with path.open(errors="replace") as lines:
            for line in lines:
                episode = parse_line(line)
                if episode is not None:
                    episodes.append({**asdict(episode), "log": path.name})
                left_out += parse_left_out(line)
    return {"folder": str(folder), "files": len(files), "episodes": episodes, "left_out": left_out}


def _exact(durations: list[float]) -> dict[str, Any]:
    ordered = sorted(durations)
    return {"count": len(ordered), "p50_s": percentile(ordered, 50) if ordered else None,
            "p95_s": percentile(ordered, 95) if ordered else None, "max_s": max(ordered, default=None)}


def log_summary(logs: dict[str, Any] | None) -> dict[str, Any] | None:
    """Exact percentiles of the logged episodes: granted waits, lapsed waits, releases (None: no logs read)."""
    if logs is None:
        return None
    episodes = logs["episodes"]

    def seconds(kind: str, outcome: str) -> list[float]:
        return [e["seconds"] for e in episodes if e["kind"] == kind and e["outcome"] == outcome]
    return {"files": logs["files"], "left_out": logs["left_out"], "waits": _exact(seconds("wait", "granted")),
            "lapsed_waits": len(seconds("wait", "lapsed")), "releases": _exact(seconds("release", "released")),
            "unserved_asks": len(seconds("release", "unserved"))}


def wait_sources(logs: dict[str, Any] | None, samples: list[dict[str, Any]],
                 clock_epoch: float | None) -> dict[str, Any] | None:
    """Granted waits split by where the memory was when each began: ``idle`` (free room plus idle
    engines' cache covered the ask), ``busy`` (only engines at work held it), ``unknown`` (no account
    sample before it). None without logs, samples or the run's clock anchor (runs before it was kept)."""
    if logs is None or not samples or clock_epoch is None:
        return None
    times = [s["t"] for s in samples]
    split: dict[str, list[float]] = {"idle": [], "busy": []}
    unknown = 0
    for episode in logs["episodes"]:
        if episode["kind"] != "wait" or episode["outcome"] != "granted":
            continue
        at = bisect.bisect_right(times, episode["began"] - clock_epoch) - 1
        source = _source(samples[at], episode) if at >= 0 else None
        if source is None:
            unknown += 1
        else:
            split[source].append(episode["seconds"])
    return {"idle": _exact(split["idle"]), "busy": _exact(split["busy"]), "unknown": unknown}


def _source(sample: dict[str, Any], episode: dict[str, Any]) -> str | None:
    for account in sample.get("accounts", []):
        members = account["members"]
        if episode["instance"] not in members:
            continue
        records = {name: MemberRecord(name=name, mapped_bytes=m["mapped_bytes"], cached_bytes=m["cached_bytes"],
                                      min_bytes=m["min_bytes"], wanted_bytes=m["wanted_bytes"])
                   for name, m in members.items()}
        budget = account["budget"]
        free = budget - sum(max(r.mapped_bytes, r.min_bytes) for r in records.values())
        idle = sum(reclaimable(r) for name, r in records.items() if name != episode["instance"]
                   and r.wanted_bytes == 0 and not uses_a_real_part(r, len(records), budget))
        return "idle" if max(0, free) + idle >= episode["asked_bytes"] else "busy"
    return None


# ------------------------------------------------------------------ text
def _s(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def render(metrics: dict[str, Any] | None, logs: dict[str, Any] | None,
           sources: dict[str, Any] | None = None) -> list[str]:
    """The summary's lines about the engines' own reclaim numbers."""
    lines = []
    if metrics is None:
        lines.append("reclaim, engines' clocks: no kvelastic_reclaim_* histograms on any server's /metrics")
    else:
        for model, m in metrics.items():
            w, r = m["waits"], m["releases"]
            lines.append(f"reclaim, engines' clocks (/metrics, p50/p95 from buckets) {model}: waits {w['count']} "
                         f"p50 ~{_s(w['p50_s'])} p95 ~{_s(w['p95_s'])} mean {_s(w['mean_s'])}, "
                         f"{m['lapsed_waits']:.0f} lapsed; releases {r['count']} p50 ~{_s(r['p50_s'])} "
                         f"p95 ~{_s(r['p95_s'])}, {m['released_bytes'] / 2**30:.2f} GiB given back, "
                         f"{m['unserved_asks']:.0f} unserved")
    if logs is not None:
        w, r = logs["waits"], logs["releases"]
        lines.append(f"reclaim, engines' logs (exact, {logs['files']} files, {logs['left_out']} lines left out): "
                     f"waits {w['count']} p50 {_s(w['p50_s'])} p95 {_s(w['p95_s'])} max {_s(w['max_s'])}, "
                     f"{logs['lapsed_waits']} lapsed; releases {r['count']} p50 {_s(r['p50_s'])} "
                     f"p95 {_s(r['p95_s'])} max {_s(r['max_s'])}, {logs['unserved_asks']} unserved")
    if sources is not None:
        i, b = sources["idle"], sources["busy"]
        lines.append(f"reclaim waits by where the memory was as each began: free or idle engines' cache "
                     f"{i['count']} p50 {_s(i['p50_s'])} p95 {_s(i['p95_s'])}; only busy engines "
                     f"{b['count']} p50 {_s(b['p50_s'])} p95 {_s(b['p95_s'])}; {sources['unknown']} unknown")
    return lines
