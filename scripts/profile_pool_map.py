"""Where the time of growing a pool goes: driver calls vs Python, warm reserve vs cold.

``bench_pool.py`` reports wall time per GiB; this script splits that time by
CUDA driver call (cuMemCreate, cuMemMap, cuMemSetAccess, cuMemsetD8Async, ...)
and the Python around them, for a 32-tensor pool grown by 1 GiB in one
``map_groups`` call. It wraps the backend's driver module in a timing proxy
(instrumentation only: every call goes through unchanged).

    python scripts/profile_pool_map.py --json $OUT/profile_pool_map.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from kvelastic.pool import PagePool
from kvelastic.pool.cuda import CudaBackend

MIB = 1024 * 1024
GIB = 1024 * MIB


class TimedDriver:
    """Forwards attribute access to the driver module; times every callable it hands out."""

    def __init__(self, driver: Any):
        self._driver = driver
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._driver, name)
        if not callable(value) or not name.startswith("cu"):
            return value

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return value(*args)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def profile(page: int, tensors: int, grow_bytes: int, warm: bool, rounds: int) -> dict[str, Any]:
    backend = CudaBackend()
    timed = TimedDriver(backend._driver)
    backend._driver = timed
    pool = PagePool.standard(backend, page_bytes=page)
    views = [pool.add_tensor(4 * GIB) for _ in range(tensors)]
    groups = grow_bytes // (page * tensors)
    walls, splits = [], []
    for _ in range(rounds):
        if warm:
            pool.grow_reserve(groups * tensors)
        torch.cuda.synchronize()
        timed.reset()
        start = time.perf_counter()
        pool.map_groups(range(groups))
        walls.append(time.perf_counter() - start)
        splits.append({name: (timed.seconds[name], timed.calls[name]) for name in timed.seconds})
        torch.cuda.synchronize()
        pool.unmap_groups(range(groups))
        if not warm:
            pool.trim_reserve(0)
    del views
    pool.close()
    gib = grow_bytes / GIB
    wall = statistics.median(walls)
    middle = splits[walls.index(sorted(walls)[len(walls) // 2])]
    driver_total = sum(seconds for seconds, _ in middle.values())
    return {"page_mib": page // MIB, "warm": warm, "ms_per_gib": wall * 1e3 / gib,
            "python_ms_per_gib": (wall - driver_total) * 1e3 / gib,
            "calls": {name: {"ms_per_gib": s * 1e3 / gib, "count": n} for name, (s, n) in sorted(middle.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-mib", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "profile_pool_map.json"))
    args = parser.parse_args()
    torch.cuda.init()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                              "torch": torch.__version__, "results": []}
    for page_mib in args.page_mib:
        for warm in (False, True):
            row = profile(page_mib * MIB, tensors=32, grow_bytes=GIB, warm=warm, rounds=args.rounds)
            report["results"].append(row)
            parts = ", ".join(f"{name} {c['ms_per_gib']:.2f} ({c['count']})" for name, c in row["calls"].items())
            print(f"{page_mib:>3} MiB {'warm' if warm else 'cold'}: {row['ms_per_gib']:7.2f} ms/GiB, "
                  f"python {row['python_ms_per_gib']:6.2f}; {parts}")
    with open(args.json, "w") as out:
        json.dump(report, out, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
