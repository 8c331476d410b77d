"""How long do the pool's maps take while another thread of the process runs pure Python? (no vLLM)

An engine core's process runs vLLM's busy loop (scheduling, input preparation, kernel launches:
Python under the GIL) beside kvelastic's threads (the mapper, the upkeep), whose work is a run of
driver calls. Each call releases the GIL and must take it back when it returns; while another
thread runs Python, CPython hands it back only when that thread releases it or, at the latest,
after the switch interval (``sys.setswitchinterval``, 5 ms by default). A page group's map is one
call per KV tensor and more (``cuMemMap``, ``cuMemSetAccess``): in the worst case each return waits
a switch interval (the "convoy effect").

Per switch interval (``--intervals``), side by side in one run: a pool like an engine's
(``--tensors`` KV tensors of ``--page-mib`` pages, the warm reserve grown first so maps create
nothing) maps ``--groups`` groups one at a time and unmaps them, ``--reps`` times, alone and
beside a thread running pure Python back to back; then grows ``--grow-mib`` of reserve the same
two ways. Printed as a table (median, p99 and max of the group maps; median growth; ``busy kept``:
the busy thread's pace beside the pool's work against its pace alone at that interval, what the
interval costs the busy loop), written as JSON::

    python benchmarks/bench_gil_convoy.py --json /tmp/gil_convoy.json                # host pages (CPU)
    python benchmarks/bench_gil_convoy.py --backend cuda --page-mib 8 --json $OUT/gil_convoy.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from kvelastic.pool import PagePool
from pool_bench_parts import PythonBusy, backend_for, busy_pace_alone, print_table, write_json  # beside this file

MIB = 1024 * 1024


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Group maps and a growth on a fresh pool, in the calling thread; ms."""
    page = args.page_mib * MIB
    pool = PagePool.standard(backend_for(args.backend), page_bytes=page, park=False, zero_on_map=False)
    tensors = [pool.add_tensor(args.groups * page) for _ in range(args.tensors)]
    maps: list[float] = []
    grows: list[float] = []
    try:
        pool.grow_reserve(args.groups * args.tensors)
        for _ in range(args.reps):
            for group in range(args.groups):
                start = time.perf_counter()
                pool.map_groups([group])
                maps.append((time.perf_counter() - start) * 1e3)
            pool.unmap_groups(range(args.groups))
            pool.collect(wait=True)
        pool.trim_reserve(0)
        for _ in range(args.reps):
            start = time.perf_counter()
            pool.grow_reserve(args.grow_mib * MIB // page)
            grows.append((time.perf_counter() - start) * 1e3)
            pool.trim_reserve(0)
    finally:
        del tensors
        pool.close()
    return {"map_median_ms": statistics.median(maps), "map_p99_ms": percentile(maps, 0.99),
            "map_max_ms": max(maps), "grow_median_ms": statistics.median(grows), "maps": len(maps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--tensors", type=int, default=32, help="KV tensors (an 8B model's layers)")
    parser.add_argument("--page-mib", type=int, default=2)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--grow-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--intervals", default="0.005,0.001,0.0002", help="switch intervals, seconds")
    parser.add_argument("--json")
    args = parser.parse_args()
    default_interval = sys.getswitchinterval()
    rows = []
    try:
        for interval in (float(x) for x in args.intervals.split(",")):
            sys.setswitchinterval(interval)
            for beside in ("alone", "python-busy"):
                kept = math.nan  # the busy thread's pace beside the pool's work, against its pace alone
                if beside == "alone":
                    result = measure(args)
                else:
                    alone = busy_pace_alone()
                    with PythonBusy() as busy:
                        result = measure(args)
                    kept = busy.units_per_s / alone
                rows.append({"switch_interval_s": interval, "switch_ms": interval * 1e3, "beside": beside,
                             "busy_kept": kept, **result})
    finally:
        sys.setswitchinterval(default_interval)
    columns = [("switch ms", "switch_ms", ">9.1f"), ("beside", "beside", "<12"), ("map p50", "map_median_ms", ">8.2f"),
               ("map p99", "map_p99_ms", ">8.2f"), ("map max", "map_max_ms", ">8.2f"),
               ("grow p50", "grow_median_ms", ">9.1f"), ("busy kept", "busy_kept", ">9.2f")]
    print_table(f"{args.tensors} tensors of {args.page_mib} MiB pages on {args.backend}: group maps "
                f"x{rows[0]['maps']}, growth of {args.grow_mib} MiB x{args.reps}", columns, rows)
    write_json(args.json, args, rows)


if __name__ == "__main__":
    main()
