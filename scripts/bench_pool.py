"""Benchmark the elastic page pool on a GPU: map/unmap cost and pool growth.

Prints a table and writes JSON. Measures, per 2 MiB page (or --page-mib):
map and unmap through the pool with the reserve warm (pages already created)
and cold (each map creates pages); then grows a 32-tensor pool (an 8B model's
layers) by 1 GiB and shrinks it back, reporting wall time per GiB: cold (the
map creates the pages), warm (pages created, not mapped) and parked (the
reserve grown as the engine's upkeep thread grows it, which maps it ahead at
the groups asked for next; "park" is that upkeep call's own time).

    python scripts/bench_pool.py --json $OUT/bench_pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvelastic.pool import PagePool
from kvelastic.pool.cuda import CudaBackend

MIB = 1024 * 1024
GIB = 1024 * MIB


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def per_page_costs(page: int, groups: int, rounds: int) -> dict[str, float]:
    """One tensor, ``groups`` groups of one page: map/unmap each group alone."""
    pool = PagePool.standard(CudaBackend(), page_bytes=page, park=False)
    tensor = pool.add_tensor(groups * page)
    results: dict[str, list[float]] = {"map_cold_us": [], "map_warm_us": [], "unmap_us": []}
    for _ in range(rounds):
        for g in range(groups):
            results["map_cold_us"].append(_timed(lambda: pool.map_groups([g])) * 1e6)
        for g in range(groups):
            results["unmap_us"].append(_timed(lambda: pool.unmap_groups([g])) * 1e6)
        for g in range(groups):
            results["map_warm_us"].append(_timed(lambda: pool.map_groups([g])) * 1e6)
        pool.unmap_groups(range(groups))
        pool.trim_reserve(0)
    del tensor
    pool.close()
    return {k: statistics.median(v) for k, v in results.items()}


def grow_shrink(page: int, tensors: int, grow_bytes: int, mode: str, rounds: int) -> dict[str, float]:
    """Grow a pool of ``tensors`` tensors by ``grow_bytes`` in one call, then shrink it back.

    ``mode``: "cold" (the map creates its pages), "warm" (created ahead, not
    mapped) or "parked" (created and mapped ahead by ``grow_reserve``).
    """
    pool = PagePool.standard(CudaBackend(), page_bytes=page, park=mode == "parked")
    views = [pool.add_tensor(4 * GIB) for _ in range(tensors)]
    groups = grow_bytes // (page * tensors)
    prepare, grow, shrink = [], [], []
    for _ in range(rounds):
        if mode != "cold":
            prepare.append(_timed(lambda: pool.grow_reserve(groups * tensors)))
        torch.cuda.synchronize()
        grow.append(_timed(lambda: pool.map_groups(range(groups))))
        shrink.append(_timed(lambda: pool.unmap_groups(range(groups))))
        pool.trim_reserve(0)
    del views
    pool.close()
    gib = grow_bytes / GIB
    result = {"grow_ms_per_gib": statistics.median(grow) * 1e3 / gib,
              "shrink_ms_per_gib": statistics.median(shrink) * 1e3 / gib}
    if prepare:
        result["prepare_ms_per_gib"] = statistics.median(prepare) * 1e3 / gib
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-mib", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_pool.json"))
    args = parser.parse_args()
    torch.cuda.init()
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                                 "torch": torch.__version__, "results": []}
    print(f"{'page':>6} {'map cold us':>12} {'map warm us':>12} {'unmap us':>9} {'grow ms/GiB: cold':>18} "
          f"{'warm':>6} {'parked':>7} {'park':>6} {'shrink ms/GiB':>14}")
    for page_mib in args.page_mib:
        page = page_mib * MIB
        costs = per_page_costs(page, groups=64, rounds=args.rounds)
        runs = {mode: grow_shrink(page, tensors=32, grow_bytes=GIB, mode=mode, rounds=args.rounds)
                for mode in ("cold", "warm", "parked")}
        row = {"page_mib": page_mib, **costs,
               **{f"grow_{mode}_ms_per_gib": run["grow_ms_per_gib"] for mode, run in runs.items()},
               "park_ms_per_gib": runs["parked"]["prepare_ms_per_gib"],
               "shrink_ms_per_gib": runs["warm"]["shrink_ms_per_gib"]}
        report["results"].append(row)  # type: ignore[union-attr]
        print(f"{page_mib:>4}Mi {costs['map_cold_us']:>12.1f} {costs['map_warm_us']:>12.1f} "
              f"{costs['unmap_us']:>9.1f} {row['grow_cold_ms_per_gib']:>18.2f} {row['grow_warm_ms_per_gib']:>6.2f} "
              f"{row['grow_parked_ms_per_gib']:>7.2f} {row['park_ms_per_gib']:>6.2f} {row['shrink_ms_per_gib']:>14.2f}")
    with open(args.json, "w") as out:
        json.dump(report, out, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
