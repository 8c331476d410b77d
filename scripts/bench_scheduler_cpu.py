"""kvelastic's scheduler-side cost per step, on the CPU: vLLM's real Scheduler over a host-backed pool.

The multi-turn chat workload of ``bench_multiturn.py`` (every turn re-sends
the growing history) drives vLLM's real Scheduler, patched through kvelastic's
activation path, over an elastic KV cache of host memory with a tight limit and
the host tier on, so turns spill and reload as on the GPU. No model runs: each
step samples one deterministic token per request whose prompt is done. After
set-up the heap is frozen as vLLM's EngineCore freezes it. Per step it times
``schedule`` and ``update_from_output`` (wall and engine-thread CPU); per tick,
the upkeep thread's CPU; and it counts GC pauses, the backend calls that are
driver calls on a GPU, and the host tier's spills and reloads.

One tree per process (whichever kvelastic the interpreter imports; the run
itself is ``sched_cpu_run.py``); ``--trees`` runs the interpreters in turns
(every other turn in reverse), ``--repeat`` times, and tabulates: this module. Their
schedules are identical (checked: the table names a run whose schedule differs, as one
of 19 did on 2026-12-02: kvelastic's threads make some decisions timing-dependent), so
step *i* of one tree is step *i* of the other: the comparison pairs them, taking each
step's least disturbed (minimum) CPU time over the repeats, what a machine shared with
other work distorts least::

    python scripts/bench_scheduler_cpu.py --trees old=/tmp/venv-old/bin/python new=.venv/bin/python \\
        --repeat 4 --json sched-cpu.json

``--profile FILE`` writes a cProfile of the measured rounds (without ``--trees``). A tree named
``vanilla`` runs vLLM's scheduler without kvelastic. ``--tp`` runs issue #19's TP model instead
(``sched_cpu_tp.py``: a cold and a warm burst, vLLM's scheduler in front of ``--world`` rank processes,
2 by default)::

    python scripts/bench_scheduler_cpu.py --tp --world 4 --trees vanilla=.venv/bin/python new=.venv/bin/python --repeat 3
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sched_cpu_run import kvelastic_environment, run_config  # noqa: E402
from sched_cpu_tp import run_tp  # noqa: E402


# ------------------------------------------------------------------ tabulation
def step_cpu(result: dict, copies: bool = True) -> list[float]:
    """The engine thread's CPU per step; without ``copies``, less the host tier's copies in it."""
    return [s[1] + s[3] - (0.0 if copies else s[5]) for s in result["steps"]]


def summarize(result: dict) -> dict:
    """One run's numbers: medians of per-step CPU (the engine thread's), per round, and the counts."""
    steps, cpu, ticks = result["steps"], step_cpu(result), result["ticks"]
    per_round: dict[int, list[float]] = {}
    for s, c in zip(steps, cpu):
        per_round.setdefault(s[4], []).append(c)
    offload, pool = result["offload"] or {}, result["pool"] or {}
    return {"name": result.get("name", result["config"]), "tree": result["tree"], "steps": len(steps),
            "step_cpu_ms_p50": 1e3 * statistics.median(cpu), "step_cpu_ms_mean": 1e3 * statistics.mean(cpu),
            "schedule_cpu_ms_p50": 1e3 * statistics.median(s[1] for s in steps),
            "update_cpu_ms_p50": 1e3 * statistics.median(s[3] for s in steps),
            "step_wall_ms_p50": 1e3 * statistics.median(s[0] + s[2] for s in steps), "total_cpu_s": sum(cpu),
            "copy_cpu_s": sum(s[5] for s in steps),
            "round_cpu_ms_p50": [round(1e3 * statistics.median(v), 3) for _, v in sorted(per_round.items())],
            "round_steps": [len(v) for _, v in sorted(per_round.items())],
            "other_threads_cpu_s": result["other_threads_cpu_s"], "thread_cpu_s": result["thread_cpu_s"],
            "ticks": len(ticks), "upkeep_cpu_s": sum(t[0] for t in ticks),
            "tick_cpu_ms_p50": 1e3 * statistics.median(t[0] for t in ticks) if ticks else 0.0,
            "gc": {g: [n, round(s, 3)] for g, (n, s) in result["gc"].items()},
            "spilled_blocks": offload.get("spilled_bytes", 0) // result["block_bytes"],
            "reloaded_blocks": offload.get("reloaded_bytes", 0) // result["block_bytes"],
            "pages_created": pool.get("pages_created"), "backend_calls": result["backend_calls"],
            "calls_per_step": result["calls_per_step"],
            "trace_hash": result["trace_hash"]}


def paired(results: list[dict]) -> dict[str, dict]:
    """Per tree, with and without the host tier's copies: each step's minimum CPU over its runs, summed,
    and paired with the first tree's same step."""
    out: dict[str, dict] = {}
    for copies in (True, False):
        by_tree: dict[str, list[list[float]]] = {}
        for result in results:
            by_tree.setdefault(result["name"].split("#")[0], []).append(step_cpu(result, copies))
        floors = {name: [min(step) for step in zip(*runs)] for name, runs in by_tree.items()}
        base = next(iter(floors.values()))
        for name, floor in floors.items():
            diffs = [1e6 * (a - b) for a, b in zip(floor, base)] if len(floor) == len(base) else [0.0]
            out.setdefault(name, {"runs": len(by_tree[name])})["with copies" if copies else "without copies"] = {
                "cpu_s": sum(floor), "step_ms_p50": 1e3 * statistics.median(floor),
                "vs_first_us_p50": statistics.median(diffs)}
    return out


def print_table(rows: list[dict], pairs: dict[str, dict] | None = None) -> None:
    print(f"{'run':<9} {'steps':>5} {'cpu p50':>8} {'sched':>6} {'update':>6} {'mean':>6} {'total':>6} {'copies':>6} "
          f"{'upkeep':>6} {'tick':>5} {'other':>5} {'spilled':>7} {'reload':>7}  per-round step cpu p50 (ms)")
    for r in rows:
        print(f"{r['name']:<9} {r['steps']:>5} {r['step_cpu_ms_p50']:>6.3f}ms {r['schedule_cpu_ms_p50']:>6.3f} "
              f"{r['update_cpu_ms_p50']:>6.3f} {r['step_cpu_ms_mean']:>6.3f} {r['total_cpu_s']:>5.2f}s {r['copy_cpu_s']:>5.2f}s "
              f"{r['upkeep_cpu_s']:>5.3f}s {r['tick_cpu_ms_p50']:>5.2f} {r['other_threads_cpu_s']:>4.2f}s "
              f"{r['spilled_blocks']:>7} {r['reloaded_blocks']:>7}  {r['round_cpu_ms_p50']} steps {r['round_steps']}")
    print("(ms of the engine thread's CPU per step, schedule + update_from_output; 'copies': the host tier's "
          "copies within them; 'upkeep': the upkeep (or reclaimer) thread's ticks, 'tick' their median ms; "
          "'other': every thread but the engine's)")
    for r in rows:
        print(f"{r['name']:<9} GC (collections, s) {r['gc']}; threads CPU s {r['thread_cpu_s']}; "
              f"pages created {r['pages_created']}; backend {r['backend_calls']}")
        if r["calls_per_step"]:
            print(f"{'':<9} calls per step (counted; timings above are slowed by the counting): {r['calls_per_step']}")
    for name, p in (pairs or {}).items():
        print(f"{name}: each step's minimum over {p['runs']} run(s), " + "; ".join(
            f"{what}: total {v['cpu_s']:.3f} s, median {v['step_ms_p50']:.3f} ms, step by step against the "
            f"first {v['vs_first_us_p50']:+.1f} us (median)" for what, v in p.items() if what != "runs"))
    kvelastic = [r for r in rows if not r["name"].startswith("vanilla")]
    odd = [r["name"] for r in kvelastic if r["trace_hash"] != kvelastic[0]["trace_hash"]] if kvelastic else []
    print("kvelastic schedules identical across runs: True" if not odd else
          f"kvelastic schedules DIFFER from {kvelastic[0]['name']}'s in {', '.join(odd)} "
          "(their steps pair with other schedules' steps)")


def run_trees(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Each tree's interpreter in its own process, in turns (``--repeat`` times), then one table.

    Every other turn runs the trees in reverse: on a 2-core VM whichever tree ran second of a
    turn took about 40 us a step less, in both orders (benchmarks/results/2026-12-02-session28),
    so an even ``--repeat`` gives each tree each place equally often.
    """
    trees = [t.split("=", 1) for t in args.trees]
    outdir = Path(tempfile.mkdtemp(prefix="bench-sched-"))
    results = []
    for k in range(args.repeat):
        for name, python in (trees if k % 2 == 0 else trees[::-1]):
            out = outdir / f"{name}-{k + 1}.json"
            config = "vanilla" if name.startswith("vanilla") else "kvelastic"
            cmd = [python, __file__, "--config", config, "--out", str(out), *passthrough,
                   *(["--count-calls"] if args.count_calls else []), *(["--tp"] if args.tp else [])]
            subprocess.run(cmd, check=True, env={k: v for k, v in os.environ.items() if k != "KVELASTIC"})
            result = json.loads(out.read_text())
            result["name"] = f"{name}#{k + 1}" if args.repeat > 1 else name
            results.append(result)
            print(f"{result['name']}: {result['tree']}", flush=True)
    rows, pairs = [summarize(r) for r in results], paired(results)
    print_table(rows, pairs)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "paired": pairs, "raw": str(outdir)}, indent=2))
    return 0


WORKLOAD = {  # passed to every tree: name, default, help
    "conversations": (64, ""), "turns": (6, ""), "first-len": (1024, ""), "turn-len": (256, ""),
    "out-len": (64, ""), "rounds": (3, "measured rounds"), "warmup": (1, "rounds run first and left out"),
    "num-blocks": (162144, "vLLM's (virtual) blocks, as on the H100"),
    "limit-blocks": (4096, "physical limit (2 GiB on the H100)"), "cpu-blocks": (32768, "host tier (16 GiB on the H100)"),
    "cpu-policy": ("arc", ""), "chunk-mib": (2, ""), "layers": (1, ""), "heads": (4, ""), "head-size": (64, ""),
    "max-num-seqs": (256, ""), "max-batched-tokens": (8192, ""), "max-model-len": (8192, ""),
    "tp-prompts": (256, "with --tp: prompts per burst"), "world": (2, "with --tp: rank processes (the TP size)"), "tp-out-len": (128, "with --tp: output tokens"),
}


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments, and the workload's as each tree's process gets them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", metavar="NAME=PYTHON", help="run each interpreter's kvelastic in turn")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --trees: how many turns each tree gets (even: each order equally often)")
    p.add_argument("--config", choices=("kvelastic", "vanilla"), default="kvelastic")
    p.add_argument("--tp", action="store_true", help="issue #19's TP model (sched_cpu_tp.py) instead of "
                   "the multi-turn workload on one cache")
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the table's numbers here (default: print only)")
    p.add_argument("--profile", help="cProfile output of the measured rounds (without --trees)")
    p.add_argument("--count-calls", action="store_true", help="count the calls in each step, by area and "
                   "function, instead of timing them (noise-free; the timings are slowed)")
    workload = p.add_argument_group("workload (passed to each tree)")
    for name, (default, text) in WORKLOAD.items():
        workload.add_argument(f"--{name}", type=type(default), default=default, help=text or None)
    args = p.parse_args(argv)
    return args, [f"--{name}={getattr(args, name.replace('-', '_'))}" for name in WORKLOAD]


def main() -> int:
    args, passthrough = parse()
    if args.trees:
        return run_trees(args, passthrough)
    if args.tp:
        result = run_tp(args)
    else:
        shared = tempfile.mkdtemp(prefix="kvelastic-shared-")
        atexit.register(shutil.rmtree, shared, True)  # registered first: runs after kvelastic's own exit work
        os.environ.update(kvelastic_environment(args, shared))
        result = run_config(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result))
        return 0
    row = summarize(result)
    print_table([row])
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [row]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
