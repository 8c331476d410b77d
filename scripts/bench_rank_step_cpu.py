"""What kvelastic adds to each step on a TP worker rank, on the CPU: the wrap of ``Worker.execute_model``.

Issue #19's TP=4 run (2026-11-28, 4 x H200, 8B) was 0.90x vanilla in both passes, the warm
one mapping next to nothing; a step that short hides per-step CPU less. The scheduler's
side is ``bench_scheduler_cpu.py --tp``; this is the ranks' side, never measured before.
Each rank is a spawned process with a real :class:`~kvelastic.tp.rank.RankWorker` over the
host-memory cache (``rank_step_probe.py`` says what is timed). Two workloads:

* ``empty``: ``--steps`` plans with no command, one after another: the warm decode step;
* ``mix``: the plans vLLM's real scheduler sends in ``sched_cpu_tp.py``'s cold and warm
  bursts (``--tp-prompts`` prompts), split into steps with no command
  and steps with some (the cold pass's maps, unmaps, reserve changes);
* ``gil``: what the rank's idle thread costs a worker's step through the GIL (one rank in
  the process; ``rank_step_probe.gil_model``): wall time lost per step, idle thread on and off.

Per step and rank: the main thread's CPU in the wrap less the bare forward's ("added"),
the part of it inside the pool's maps and unmaps ("pool": driver calls on a GPU), and the
unpickling of the plan; per rank, the idle thread's CPU per second. Figures are medians
over the steps of each rank, then over ranks and over ``--repeat`` runs (each in its own
process; with ``--trees NAME=PYTHON`` the trees take turns, as in ``bench_scheduler_cpu.py``)::

    python scripts/bench_rank_step_cpu.py --world 4 --repeat 3 --json rank-step.json
    python scripts/bench_rank_step_cpu.py --trees old=/tmp/py-old new=.venv/bin/python --world 4
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sched_cpu_tp import BLOCKS, GROUP_BLOCKS, run_tp  # noqa: E402  (puts the repository on the path too)

MODES = ("empty", "mix", "gil")


def _shape() -> tuple[int, int]:
    from tests.kv_fixtures import HALF

    return (BLOCKS, GROUP_BLOCKS * HALF)


def run_empty(args: argparse.Namespace) -> tuple[list[dict], list[int]]:
    """``args.steps`` plans without commands to ``args.world`` timing ranks; their results, one round."""
    from kvelastic.tp.protocol import StepPlan
    from rank_step_probe import TimingRanks

    ranks = TimingRanks(args.world, _shape(), args.profile)
    try:
        for step in range(1, args.steps + 1):
            ranks.send(StepPlan(step=step))
    finally:
        ranks.close()
    return ranks.results, [args.steps]


def run_mix(args: argparse.Namespace) -> tuple[list[dict], list[int], str]:
    """The real scheduler's cold and warm bursts through ``args.world`` timing ranks; results, steps per
    pass, and the schedule's hash (equal across trees that decide alike)."""
    from rank_step_probe import TimingRanks

    made: list[TimingRanks] = []

    def make_ranks(world: int) -> TimingRanks:
        made.append(TimingRanks(world, _shape(), args.profile))
        return made[-1]

    tp_args = argparse.Namespace(config="kvelastic", tp_prompts=args.tp_prompts, tp_out_len=args.tp_out_len,
                                 world=args.world, profile=None, count_calls=False)
    result = run_tp(tp_args, make_ranks)
    return made[0].results, [r["steps"] for r in result["rounds"]], result["trace_hash"]


def one_run(args: argparse.Namespace) -> dict:
    """One process's run of ``args.mode``: every rank's records, as JSON-able lists."""
    import kvelastic

    shared = tempfile.mkdtemp(prefix="kvelastic-shared-")
    atexit.register(shutil.rmtree, shared, True)
    os.environ["KVELASTIC_SHARED_DIR"] = shared
    trace = ""
    if args.mode == "gil":
        from rank_step_probe import gil_model

        return {"mode": "gil", "world": args.world, "tree": str(Path(kvelastic.__file__).resolve().parents[1]),
                "gil": gil_model(args.world, _shape(), args.steps // 4), "trace_hash": "",
                "round_steps": [args.steps // 4]}
    if args.mode == "empty":
        ranks, rounds = run_empty(args)
    else:
        ranks, rounds, trace = run_mix(args)
    return {"mode": args.mode, "world": args.world, "tree": str(Path(kvelastic.__file__).resolve().parents[1]),
            "ranks": ranks, "round_steps": rounds, "trace_hash": trace}


# ------------------------------------------------------------------ tabulation
def _us(values: list[float], q: float = 0.5) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return 1e6 * values[min(len(values) - 1, int(q * len(values)))]


def categories(result: dict) -> dict[str, list[int]]:
    """Record indexes by kind of step: all, no command, some command (and in ``mix``, the warm pass's)."""
    records = result["ranks"][0]["records"]
    cold = result["round_steps"][0] if result["mode"] == "mix" else 0
    out = {"all": list(range(len(records))),
           "no command": [i for i, r in enumerate(records) if r[1] == 0],
           "commands": [i for i, r in enumerate(records) if r[1] > 0]}
    if result["mode"] == "mix":
        out["warm pass"] = list(range(cold, len(records)))
    return out


def summarize(result: dict) -> dict[str, dict]:
    """Per kind of step: medians over ranks of each rank's median (and p90, mean) of each figure, in us."""
    if result["mode"] == "gil":
        return {kind: {"steps": len(lost), "lost_mean": 1e6 * statistics.mean(lost), "lost_p50": _us(lost),
                       "lost_p99": _us(lost, 0.99)} for kind, lost in result["gil"].items()}
    rows: dict[str, dict] = {}
    for kind, index in categories(result).items():
        if not index:
            continue
        per_rank: list[dict] = []
        for rank in result["ranks"]:
            rec = [rank["records"][i] for i in index]
            added = [r[4] - r[6] for r in rec]
            own = [r[4] - r[6] - r[7] for r in rec]
            per_rank.append({"added_p50": _us(added), "added_p90": _us(added, 0.9),
                             "added_mean": 1e6 * statistics.mean(added), "own_p50": _us(own),
                             "own_mean": 1e6 * statistics.mean(own), "pool_mean": 1e6 * statistics.mean(r[7] for r in rec),
                             "wall_p50": _us([r[5] for r in rec]), "unpickle_p50": _us([r[3] for r in rec]),
                             "idle_ms_per_s": 1e3 * rank["idle_cpu_s"] / max(rank["wall_s"], 1e-9)})
        rows[kind] = {"steps": len(index), **{k: statistics.median(r[k] for r in per_rank) for k in per_rank[0]}}
    return rows


def combine(runs: list[dict]) -> dict[str, dict]:
    """Several runs' summaries of one tree and mode: each figure's median over the runs."""
    out: dict[str, dict] = {}
    for kind in runs[0]:
        present = [r[kind] for r in runs if kind in r]
        out[kind] = {k: statistics.median(r[k] for r in present) for k in present[0]}
    return out


def print_table(table: dict[str, dict[str, dict]]) -> None:
    print(f"{'tree/mode':<22} {'steps':<16} {'steps':>5} {'added':>7} {'p90':>7} {'mean':>7} {'own':>7} "
          f"{'ownmean':>7} {'pool':>7} {'wall':>7} {'unpkl':>6} {'idle':>6}")
    for name, rows in table.items():
        for kind, r in rows.items():
            if "lost_mean" in r:
                continue
            print(f"{name:<22} {kind:<16} {r['steps']:>5.0f} {r['added_p50']:>7.1f} {r['added_p90']:>7.1f} "
                  f"{r['added_mean']:>7.1f} {r['own_p50']:>7.1f} {r['own_mean']:>7.1f} {r['pool_mean']:>7.1f} "
                  f"{r['wall_p50']:>7.1f} {r['unpickle_p50']:>6.1f} {r['idle_ms_per_s']:>6.2f}")
    print("(us of a rank's main-thread CPU per step: 'added' = the wrap less the bare forward, median; 'own' = "
          "added less the pool's maps/unmaps ('pool', mean); 'wall': the wrap's wall time; 'unpkl': unpickling "
          "the plan; 'idle': the rank's idle thread, ms CPU per s. Medians over ranks, then over runs)")
    for name, rows in table.items():
        for kind, r in rows.items():
            if "lost_mean" in r:
                print(f"{name:<22} {kind:<16} {r['steps']:>5.0f} steps: wall lost per step mean {r['lost_mean']:.1f} us, "
                      f"median {r['lost_p50']:.1f}, p99 {r['lost_p99']:.1f}")


def run_trees(args: argparse.Namespace) -> dict:
    """Each tree (default: this interpreter) and mode in its own process, in turns, ``--repeat`` times."""
    trees = [t.split("=", 1) for t in args.trees] if args.trees else [("this", sys.executable)]
    outdir = Path(tempfile.mkdtemp(prefix="bench-rank-"))
    summaries: dict[str, list[dict]] = {}
    hashes: dict[str, set[str]] = {}
    for k in range(args.repeat):
        for mode in args.modes:
            for name, python in trees:
                out = outdir / f"{name}-{mode}-{k + 1}.json"
                cmd = [python, __file__, "--one", "--mode", mode, "--out", str(out), "--world", str(args.world),
                       "--steps", str(args.steps), "--tp-prompts", str(args.tp_prompts),
                       "--tp-out-len", str(args.tp_out_len), *(["--profile", args.profile] if args.profile else [])]
                subprocess.run(cmd, check=True, env={k: v for k, v in os.environ.items() if k != "KVELASTIC"})
                result = json.loads(out.read_text())
                summaries.setdefault(f"{name}/{mode}", []).append(summarize(result))
                if result["trace_hash"]:
                    hashes.setdefault(name, set()).add(result["trace_hash"])
                print(f"{name}/{mode} #{k + 1}: {result['tree']} steps {result['round_steps']} "
                      f"hash {result['trace_hash'] or '-'}", flush=True)
    table = {name: combine(runs) for name, runs in summaries.items()}
    return {"world": args.world, "runs": args.repeat, "table": table, "hashes": {n: sorted(h) for n, h in hashes.items()},
            "raw": str(outdir)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="rank processes (the TP size)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=2000, help="empty: plans sent")
    p.add_argument("--tp-prompts", type=int, default=256, help="mix: prompts per burst")
    p.add_argument("--tp-out-len", type=int, default=128, help="mix: output tokens")
    p.add_argument("--repeat", type=int, default=1, help="runs of each tree and mode, in turns")
    p.add_argument("--trees", nargs="+", metavar="NAME=PYTHON", help="interpreters whose kvelastic runs, in turns")
    p.add_argument("--json", default="bench_rank_step_cpu.json")
    p.add_argument("--profile", help="cProfile of each rank's wraps, to PROFILE.rank<r> (timings then slowed)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse()
    if args.one:
        Path(args.out).write_text(json.dumps(one_run(args)))
        return 0
    found = run_trees(args)
    print_table(found["table"])
    for name, hashes in found["hashes"].items():
        print(f"{name}: schedule hashes {hashes}" + ("" if len(hashes) == 1 else "  (DIFFER)"))
    if len({h for hs in found["hashes"].values() for h in hs}) > 1:
        print("the trees' schedules DIFFER")
    Path(args.json).write_text(json.dumps(found, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
