"""The alternated A/B table of ``benchmarks/ab_multiturn.sh``: runs in call order, trees pooled, tokens checked.

The run files are written as ``bench_multiturn.py`` writes them (its own
``summarize`` reads them here too); their contents are made up for the test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ab_table import load_runs, render, table  # noqa: E402


def _run(config: str, seconds: list[float], outputs: list[list[int]]) -> dict:
    def turn(k: int) -> dict:
        return {"prompt_tokens": 1000, "cached_tokens": 800 if k else 0, "ttft": [0.1, 0.2],
                "outputs": outputs}
    return {"config": config, "rounds": [{"warmup": i == 0, "seconds": s, "turns": [turn(0), turn(1)]}
                                        for i, s in enumerate(seconds)]}


def test_trees_are_pooled_over_their_runs_and_tokens_checked_against_the_first(tmp_path):
    same, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 7]]
    runs = {"old-1": _run("kvelastic", [9.0, 1.0, 1.0, 1.0], same),
            "new-2": _run("kvelastic", [9.0, 2.0, 2.0, 2.0], same),
            "new-3": _run("kvelastic", [9.0, 2.0, 2.0, 2.0], other),
            "old-4": _run("kvelastic", [9.0, 1.0, 1.0, 1.0], same)}
    for name, result in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    (tmp_path / "kvelastic.json").write_text("{}")  # not a run of the A/B: left alone
    loaded = load_runs(tmp_path)
    assert [(tree, place) for tree, place, _ in loaded] == [("old", 1), ("new", 2), ("new", 3), ("old", 4)]
    result = table(loaded, out_len=3)
    per_round = (2 * 1000 + 2 * 2 * 3) / 1.0  # prompt tokens and outputs of a round over its seconds
    assert result["trees"]["old"] == {"rounds": 6, "tok_s_median": per_round, "tok_s_min": per_round,
                                      "tok_s_max": per_round}  # the warm-up rounds are left out
    assert result["trees"]["new"]["tok_s_median"] == pytest.approx(per_round / 2)
    assert result["new_over_old"] == pytest.approx(0.5)
    # every output of every round, warm-up included: 4 rounds x 2 turns x 2 conversations
    assert [row["identical_to_first"] for row in result["runs"]] == [[16, 16], [16, 16], [8, 16], [16, 16]]
    assert "new / old: 0.500" in render(result)


def test_a_variant_run_is_a_tree_of_its_own_set_against_old(tmp_path):
    same = [[1, 2, 3], [4, 5, 6]]
    runs = {"old-1": _run("kvelastic", [9.0, 1.0, 1.0, 1.0], same),
            "new.si1ms-2": _run("kvelastic-si1ms", [9.0, 4.0, 4.0, 4.0], same),
            "new-3": _run("kvelastic", [9.0, 2.0, 2.0, 2.0], same)}
    for name, result in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    result = table(load_runs(tmp_path), out_len=3)
    assert sorted(result["trees"]) == ["new", "new.si1ms", "old"]
    assert result["trees"]["new.si1ms"]["over_old"] == pytest.approx(0.25)
    assert result["trees"]["new"]["over_old"] == pytest.approx(0.5)
    assert "over_old" not in result["trees"]["old"]
    assert "new.si1ms: median of 3 rounds" in render(result) and "0.250x old" in render(result)


def test_the_engine_s_own_copy_times_come_from_the_last_copy_clock_line_of_its_log(tmp_path):
    same = [[1, 2, 3], [4, 5, 6]]
    (tmp_path / "old-1.json").write_text(json.dumps(_run("kvelastic", [9.0, 1.0, 1.0, 1.0], same)))
    (tmp_path / "old-1.log").write_text("INFO kvelastic: mapped 1 GiB; host tier 2 GiB, hits 3\n")  # before the clock
    (tmp_path / "new-2.json").write_text(json.dumps(_run("kvelastic", [9.0, 1.0, 1.0, 1.0], same)))
    (tmp_path / "new-2.log").write_text(
        "INFO kvelastic: ...; copies on the GPU: spill 0.10 s (40.0 GB/s), reload 0.20 s (45.5 GB/s)\n"
        "INFO kvelastic: ...; copies on the GPU: spill 1.25 s (47.9 GB/s), reload 2.50 s (48.3 GB/s); write-through\n")
    result = table(load_runs(tmp_path), out_len=3)
    assert [row["engine_copies"] for row in result["runs"]] == [
        None, {"spill_s": 1.25, "spill_rate": "47.9 GB/s", "reload_s": 2.5, "reload_rate": "48.3 GB/s"}]
    text = render(result)
    assert "1.25 s (47.9 GB/s), 2.50 s (48.3 GB/s)" in text and text.splitlines()[1].endswith("  -")
