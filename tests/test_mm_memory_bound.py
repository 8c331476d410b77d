"""Whether a busy period of the multi-model benchmark was bound by KV memory, from vLLM's own /metrics.

Static runs have no kvelastic account whose wants would say so; vLLM's gauges do: requests waiting
while the KV cache is full.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.mmbench.summary import queued_on_full_kv  # noqa: E402


def _sample(t: float, usage: float | None, waiting: float) -> dict:
    values = {"vllm:num_requests_waiting": waiting, "vllm:num_requests_running": 30.0}
    if usage is not None:
        values["vllm:kv_cache_usage_perc"] = usage
    return {"t": t, "servers": {"model-a": values, "model-b": {}}}


def test_only_samples_with_a_full_cache_and_a_queue_count_within_the_period():
    result = {"metrics": {"samples": [
        _sample(1.0, 0.99, 12),   # full and queued
        _sample(2.0, 0.99, 0),    # full, nothing waiting: not bound by memory
        _sample(3.0, 0.50, 20),   # queued with room: bound by something else
        _sample(4.0, 0.98, 3),    # full and queued
        _sample(5.0, None, 3),    # no gauge in this sample: not counted either way
        _sample(9.0, 1.00, 9),    # after the period
    ]}}
    assert queued_on_full_kv(result, "model-a", 0.0, 6.0) == 0.5
    assert queued_on_full_kv(result, "model-a", 8.0, 10.0) == 1.0
    assert queued_on_full_kv(result, "model-b", 0.0, 10.0) is None  # never answered with its gauges
