"""Reclaim waits of the multi-model benchmark, split by where the memory was when each began.

Issue #20's reclaim latency is about memory an idle model holds; a wait for memory that busy
engines hold (given back as their requests finish) is another thing. The split reads the account
sample taken just before each wait, with the fair-share policy's own notion of idle.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.mmbench.reclaim import render, wait_sources  # noqa: E402

GIB = 1 << 30
EPOCH = 1_800_000_000.0  # the wall time of the client's t = 0


def _member(mapped: float, cached: float = 0, wanted: float = 0) -> dict:
    return {"mapped_bytes": int(mapped * GIB), "cached_bytes": int(cached * GIB), "host_bytes": 0,
            "wanted_bytes": int(wanted * GIB), "max_bytes": 18 * GIB, "min_bytes": 0}


def _sample(t: float, **members: dict) -> dict:
    return {"t": t, "accounts": [{"gpu": "gpu-x", "budget": 18 * GIB, "members": members}]}


def _wait(t: float, seconds: float, asked_gib: float = 1, outcome: str = "granted") -> dict:
    return {"kind": "wait", "outcome": outcome, "instance": "model-a", "seconds": seconds, "began": EPOCH + t,
            "asked_bytes": int(asked_gib * GIB), "moved_bytes": 0, "events": 3, "log": "model-a.log"}


def test_waits_are_put_to_idle_cache_or_to_busy_engines_by_the_sample_before_them():
    samples = [
        # b idle with 4 GiB of cache, c works: b's cache covers a's ask
        _sample(10.0, **{"model-a": _member(8, wanted=1), "model-b": _member(4.2, cached=4),
                         "model-c": _member(5.8, cached=0.5)}),
        # b now works too (beyond its cache more than an eighth of an equal part): nothing idle to give
        _sample(20.0, **{"model-a": _member(8, wanted=1), "model-b": _member(6, cached=2),
                         "model-c": _member(4, cached=0.5)}),
    ]
    logs = {"episodes": [_wait(12.0, 0.2), _wait(25.0, 4.0), _wait(26.0, 3.0),
                         _wait(5.0, 0.1),  # before any sample
                         _wait(13.0, 9.0, outcome="lapsed"),  # not a granted wait: left out
                         {**_wait(14.0, 1.0), "kind": "release", "outcome": "released"}]}
    sources = wait_sources(logs, samples, EPOCH)
    assert sources["idle"]["count"] == 1 and sources["idle"]["p50_s"] == 0.2
    assert sources["busy"]["count"] == 2 and sources["busy"]["max_s"] == 4.0
    assert sources["unknown"] == 1
    line = render(None, None, sources)[-1]
    assert "free or idle engines' cache 1 p50 200 ms" in line and "only busy engines 2" in line
    assert wait_sources(logs, samples, None) is None  # a run from before the clock anchor was kept
    assert wait_sources(None, samples, EPOCH) is None


def test_free_room_in_the_budget_counts_as_available_memory():
    samples = [_sample(1.0, **{"model-a": _member(6, wanted=1), "model-b": _member(6), "model-c": _member(4)})]
    sources = wait_sources({"episodes": [_wait(2.0, 0.05, asked_gib=2), _wait(3.0, 2.5, asked_gib=3)]},
                           samples, EPOCH)  # 2 GiB of the 18 are free; b and c work
    assert (sources["idle"]["count"], sources["busy"]["count"]) == (1, 1)
