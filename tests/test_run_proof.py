"""The benchmark drivers' proof that a kvelastic run used kvelastic rests on one log line.

If the runtime's capacity line is reworded, every driver would fail every
kvelastic run; if the proof matched too loosely, a vanilla engine would pass.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from kvelastic.settings import Settings
from kvelastic.startup.runtime import Runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from run_proof import inactive_reason, kvelastic_took_effect  # noqa: E402

GIB = 1 << 30


def test_the_runtime_s_capacity_line_is_the_proof(caplog) -> None:
    with caplog.at_level(logging.INFO):
        Runtime(Settings(enabled=True)).plan_capacity(profiled_bytes=4 * GIB, device_total_bytes=80 * GIB)
    assert kvelastic_took_effect(caplog.text)


def test_a_vanilla_engine_log_is_refused_with_the_way_out(tmp_path: Path) -> None:
    log = tmp_path / "kvelastic.log"
    log.write_text("INFO [gpu_worker.py:538] Available KV cache memory: 67.7 GiB\n"
                   "WARNING kvelastic is importable from the repo root\n")
    reason = inactive_reason(log)
    assert reason is not None and "never took effect" in reason and "pip install" in reason
    assert inactive_reason(tmp_path / "missing.log") is not None
    log.write_text("(EngineCore pid=1) INFO [runtime.py:78] kvelastic: KV cache virtual 80 GiB, physical limit 4 GiB\n")
    assert inactive_reason(log) is None
