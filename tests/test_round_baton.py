"""``bench_multiturn.py --interleave``: engines in their own processes take one round each in turn.

The paired per-round ratios it prints are only paired if no two engines ever run a round at the same
time and every engine's round r runs between the others' rounds r-1 and r+1. Real processes, real
files in a private directory, as on the GPU machine; the players here sleep instead of serving.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from round_baton import Conductor, rotated  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PLAYER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from round_baton import Player
    baton, name, rounds, die_after = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    player = Player(baton, name, timeout_s=30)
    time.sleep(0.05 * len(name))  # engines come up at different times
    player.ready()
    with open(f"{baton}/log-{name}", "w") as log:
        for r in range(rounds):
            if r == die_after:
                sys.exit(3)
            player.wait_turn(r)
            log.write(f"{r} {time.monotonic()}\\n"); log.flush()
            time.sleep(0.02)
            log.write(f"{r} {time.monotonic()}\\n"); log.flush()
            player.done(r)
""")


def _start(tmp_path: Path, name: str, rounds: int, die_after: int = -1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PLAYER, str(BENCHMARKS), str(tmp_path), name, str(rounds),
                             str(die_after)])


def _intervals(tmp_path: Path, name: str) -> dict[int, tuple[float, float]]:
    lines = [line.split() for line in (tmp_path / f"log-{name}").read_text().splitlines()]
    return {int(lines[i][0]): (float(lines[i][1]), float(lines[i + 1][1])) for i in range(0, len(lines), 2)}


def test_rounds_run_one_engine_at_a_time_in_rotating_order(tmp_path: Path) -> None:
    names = ["a", "bb", "ccc"]
    players = {name: _start(tmp_path, name, 4) for name in names}
    conductor = Conductor(tmp_path, players)
    assert conductor.wait_ready() == names
    orders = [conductor.play_round(r) for r in range(4)]
    assert [p.wait(timeout=30) for p in players.values()] == [0, 0, 0]
    assert orders == [rotated(names, r) for r in range(4)]
    assert [order[0] for order in orders] == ["a", "bb", "ccc", "a"]
    spans = sorted((span, name, r) for name in names for r, span in _intervals(tmp_path, name).items())
    for (first, _, round_a), (second, _, round_b) in zip(spans, spans[1:]):
        assert first[1] <= second[0]  # no two rounds overlap
        assert round_a <= round_b  # and round r of every engine comes before any round r+1


def test_an_engine_that_dies_is_dropped_and_the_others_play_on(tmp_path: Path) -> None:
    players = {"a": _start(tmp_path, "a", 3), "bb": _start(tmp_path, "bb", 3, die_after=1)}
    conductor = Conductor(tmp_path, players)
    assert conductor.wait_ready() == ["a", "bb"]
    orders = [conductor.play_round(r) for r in range(3)]
    assert orders[0] == ["a", "bb"] and orders[2] == ["a"]
    assert conductor.gone == {"bb"}
    assert players["a"].wait(timeout=30) == 0 and players["bb"].wait(timeout=30) == 3
    assert sorted(_intervals(tmp_path, "a")) == [0, 1, 2]


def test_the_ideal_config_holds_the_gpu_and_cpu_budgets_on_the_gpu_and_the_others_the_gpu_budget():
    """``bench_multiturn.py --configs ... ideal``: the bound, vanilla vLLM with everything on the GPU."""
    import argparse

    from bench_multiturn import vllm_kv_bytes

    for config, want in (("ideal", 18), ("vanilla", 2), ("offload-lru", 2)):
        assert vllm_kv_bytes(argparse.Namespace(config=config, gpu_kv_bytes=2, cpu_bytes=16)) == want
