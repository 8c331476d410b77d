"""The percentile every benchmark here quotes: nearest rank below, on sorted values.

One definition, so a TTFT p99 in the multi-turn benchmark and in the multi-model one mean the
same thing. Imported as ``percentiles`` by the drivers beside it (run as scripts) and as
``benchmarks.percentiles`` by ``mmbench`` (the repository root on ``sys.path``).
"""

from __future__ import annotations


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of sorted values (nearest rank below)."""
    return ordered[int(q / 100 * (len(ordered) - 1))]
