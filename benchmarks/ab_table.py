"""Tabulate an alternated A/B of ``bench_multiturn.py`` runs (``ab_multiturn.sh``): per run, per tree, the ratio.

Each run is one ``<outdir>/<tag>-<n>.json`` of ``bench_multiturn.py --config``
(tag ``old``, ``new`` or ``vanilla``, or one of them with a variant's name,
``new.si1ms``; ``n`` its place in the call's order). Runs
of one tree are pooled by the median of their rounds' throughput, so a drift
across the call (the machine warming, page cache) lands on both trees alike
when the order is symmetric (old new new old). Outputs: every run's against
the first run's, token by token (all greedy on the same conversations). Where the
run's engine log (``<tag>-<n>.log``) has kvelastic's copy clock, the last such line
gives the engine's own GPU time and rate for its spills and reloads (cumulative,
so the run's last seconds are left out): the same copies timed inside the engine,
whatever the host buffer behind them.

    python3 benchmarks/ab_table.py OUTDIR --json ab.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_multiturn, beside this file
from bench_multiturn import identical, summarize  # noqa: E402

RUN = re.compile(r"^((?:old|new|vanilla)(?:\.\w+)?)-(\d+)\.json$")
COPY_CLOCK = re.compile(r"copies on the GPU: spill ([\d.]+) s \(([^)]*)\), reload ([\d.]+) s \(([^)]*)\)")


def engine_copies(log: str) -> dict | None:
    """The last copy-clock figures in an engine log: spill and reload GPU seconds and rates; None without."""
    found = COPY_CLOCK.findall(log)
    if not found:
        return None
    spill_s, spill_rate, reload_s, reload_rate = found[-1]
    return {"spill_s": float(spill_s), "spill_rate": spill_rate, "reload_s": float(reload_s),
            "reload_rate": reload_rate}


def load_runs(outdir: Path) -> list[tuple[str, int, dict]]:
    """Every run of the call, in its order: (tree, place, result)."""
    found = []
    for path in outdir.iterdir():
        if (match := RUN.match(path.name)) is not None:
            result = json.loads(path.read_text())
            log = path.with_suffix(".log")
            if log.exists():
                result["engine_copies"] = engine_copies(log.read_text(errors="replace"))
            found.append((match.group(1), int(match.group(2)), result))
    return sorted(found, key=lambda run: run[1])


def table(runs: list[tuple[str, int, dict]], out_len: int) -> dict:
    """Per run its summary and tokens against the first run; per tree the median of all its rounds."""
    first = runs[0][2]
    rows, rounds = [], {}
    for tree, place, result in runs:
        row = summarize(result, out_len)
        row.update(tree=tree, place=place, identical_to_first=list(identical(first, result)),
                   engine_copies=result.get("engine_copies"))
        rows.append(row)
        rounds.setdefault(tree, []).extend(x["tok_s"] for x in row["rounds"])
    trees = {tree: {"rounds": len(values), "tok_s_median": statistics.median(values),
                    "tok_s_min": min(values), "tok_s_max": max(values)} for tree, values in rounds.items()}
    ratio = None
    if "old" in trees and "new" in trees:
        ratio = trees["new"]["tok_s_median"] / trees["old"]["tok_s_median"]
    if "old" in trees:
        for name, t in trees.items():
            if name != "old":
                t["over_old"] = t["tok_s_median"] / trees["old"]["tok_s_median"]
    return {"runs": rows, "trees": trees, "new_over_old": ratio}


def render(result: dict) -> str:
    lines = [f"{'run':<16} {'tok/s':>9} {'(min-max)':>17} {'TTFT p50':>9} {'TTFT p99':>9} {'same as first':>14}"
             f"  engine's GPU copies: spill, reload"]
    for row in result["runs"]:
        same, total = row["identical_to_first"]
        copies = row.get("engine_copies")
        clock = (f"{copies['spill_s']:.2f} s ({copies['spill_rate']}), {copies['reload_s']:.2f} s "
                 f"({copies['reload_rate']})") if copies else "-"
        lines.append(f"{row['tree'] + '-' + str(row['place']):<16} {row['tok_s']:>9.0f} "
                     f"{row['tok_s_min']:>8.0f}-{row['tok_s_max']:<8.0f} {row['ttft_p50']:>9.3f} "
                     f"{row['ttft_p99']:>9.3f} {same:>7}/{total:<6}  {clock}")
    for tree, t in result["trees"].items():
        over_old = f", {t['over_old']:.3f}x old" if "over_old" in t else ""
        lines.append(f"{tree}: median of {t['rounds']} rounds {t['tok_s_median']:.0f} tok/s "
                     f"(rounds {t['tok_s_min']:.0f}-{t['tok_s_max']:.0f}){over_old}")
    if result["new_over_old"] is not None:
        lines.append(f"new / old: {result['new_over_old']:.3f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", type=Path)
    p.add_argument("--out-len", type=int, default=64, help="as given to bench_multiturn.py")
    p.add_argument("--json")
    args = p.parse_args()
    runs = load_runs(args.outdir)
    if not runs:
        print(f"no old-N.json, new-N.json or vanilla-N.json in {args.outdir}", file=sys.stderr)
        return 1
    result = table(runs, args.out_len)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
