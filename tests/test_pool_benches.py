"""The pool's CPU-runnable benchmarks run end to end on host pages and report what they measured.

They are measurements, not tests of speed: this checks that they still run against today's pool
and that what they count (account transactions per configuration) is what the configuration means.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, json_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVELASTIC_SHARED_DIR", None)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args, "--json", str(json_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(json_path.read_text())


def test_bench_account_pages_counts_a_transaction_per_call_upstream(tmp_path):
    report = run_script("bench_account_pages.py", "--reps", "1", "--grow-mib", "8", "--page-mib", "2",
                        json_path=tmp_path / "account.json")
    rows = {(r["config"], r["beside"]): r for r in report["results"]}
    assert set(rows) == {(c, b) for c in ("no-account", "page-a-call", "batched") for b in ("alone", "python-busy")}
    for beside in ("alone", "python-busy"):
        assert rows[("no-account", beside)]["grow_transactions"] == 0
        assert rows[("page-a-call", beside)]["grow_transactions"] == 4  # four 2 MiB pages, one call each
        assert rows[("page-a-call", beside)]["trim_transactions"] == 4
        assert rows[("batched", beside)]["grow_transactions"] == 1  # 8 MiB in one batch of 32 MiB
        assert rows[("batched", beside)]["trim_transactions"] == 1


def test_bench_gil_convoy_runs_each_interval_alone_and_beside_python(tmp_path):
    report = run_script("bench_gil_convoy.py", "--reps", "1", "--groups", "2", "--tensors", "4", "--grow-mib", "8",
                        "--intervals", "0.005,0.001", json_path=tmp_path / "gil.json")
    rows = report["results"]
    assert [(r["switch_interval_s"], r["beside"]) for r in rows] == [
        (0.005, "alone"), (0.005, "python-busy"), (0.001, "alone"), (0.001, "python-busy")]
    assert all(r["maps"] == 2 and r["map_max_ms"] >= r["map_median_ms"] > 0 for r in rows)
    assert all(math.isnan(r["busy_kept"]) for r in rows if r["beside"] == "alone")
    assert all(r["busy_kept"] > 0 for r in rows if r["beside"] == "python-busy")  # the busy thread ran beside
