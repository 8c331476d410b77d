"""What makes cuMemSetAccess cost ~25-40 µs per mapping, and what avoids it.

``profile_pool_map.py`` shows cuMemSetAccess is most of the time of growing a
pool (about 4.8 of 6.4 ms per GiB at 8 MiB chunks, warm). This script tries,
on raw driver calls (no pool), with N mappings of one chunk size:

1. one call per mapping vs one call over the whole contiguous run;
2. the same calls spread over 2, 4, 8 threads (does the driver serialise them?);
3. slices of one large physical allocation (cuMemMap with an offset), to see
   whether the cost is per mapping or per physical allocation;
4. mappings whose handle was mapped (and granted access) before, at another address.

    python scripts/bench_set_access.py --json $OUT/bench_set_access.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from typing import Any, Callable

import torch
from cuda.bindings import driver as d

MIB = 1 << 20


def ok(result: Any) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err):
        raise RuntimeError(f"driver error {err}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


class Vmm:
    def __init__(self) -> None:
        torch.cuda.init()
        torch.empty(1, device="cuda")
        ok(d.cuInit(0))
        self.dev = ok(d.cuDeviceGet(0))
        self.ctx = ok(d.cuDevicePrimaryCtxRetain(self.dev))
        ok(d.cuCtxSetCurrent(self.ctx))
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        self.prop = prop
        acc = d.CUmemAccessDesc()
        acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = 0
        acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.acc = [acc]

    def create(self, nbytes: int) -> Any:
        return ok(d.cuMemCreate(nbytes, self.prop, 0))

    def reserve(self, nbytes: int, align: int) -> int:
        return int(ok(d.cuMemAddressReserve(nbytes, align, 0, 0)))


def timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def set_access_threads(vmm: Vmm, runs: list[tuple[int, int]], threads: int) -> float:
    """Grant access to every (address, nbytes) run, the runs split over ``threads`` threads."""
    chunks = [runs[i::threads] for i in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def work(mine: list[tuple[int, int]]) -> None:
        ok(d.cuCtxSetCurrent(vmm.ctx))
        barrier.wait()
        for address, nbytes in mine:
            ok(d.cuMemSetAccess(address, nbytes, vmm.acc, 1))
        barrier.wait()

    workers = [threading.Thread(target=work, args=(c,)) for c in chunks]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    barrier.wait()
    elapsed = time.perf_counter() - start
    for w in workers:
        w.join()
    return elapsed


def one_layout(vmm: Vmm, chunk: int, count: int, slice_of: int, rounds: int) -> dict[str, float]:
    """``count`` mappings of ``chunk`` bytes; handles of ``slice_of`` bytes each cut into slices."""
    per_handle = slice_of // chunk
    handles = [vmm.create(slice_of) for _ in range(count // per_handle)]
    base = vmm.reserve(count * chunk, chunk)
    other = vmm.reserve(count * chunk, chunk)
    out: dict[str, list[float]] = {}

    def map_all(at: int) -> None:
        for i in range(count):
            h = handles[i // per_handle]
            ok(d.cuMemMap(at + i * chunk, chunk, (i % per_handle) * chunk, h, 0))

    def unmap_all(at: int) -> None:
        for i in range(count):
            ok(d.cuMemUnmap(at + i * chunk, chunk))

    runs_one = [(base + i * chunk, chunk) for i in range(count)]
    for _ in range(rounds):
        out.setdefault("map_us", []).append(timed(lambda: map_all(base)) * 1e6 / count)
        out.setdefault("set_access_per_mapping_us", []).append(set_access_threads(vmm, runs_one, 1) * 1e6 / count)
        unmap_all(base)
        map_all(base)
        out.setdefault("set_access_one_call_us", []).append(
            timed(lambda: ok(d.cuMemSetAccess(base, count * chunk, vmm.acc, 1))) * 1e6 / count)
        for threads in (2, 4, 8):
            unmap_all(base)
            map_all(base)
            out.setdefault(f"set_access_{threads}_threads_us", []).append(
                set_access_threads(vmm, runs_one, threads) * 1e6 / count)
        unmap_all(base)
        # the same handles at another address right after: does a previous grant make it cheaper?
        map_all(other)
        out.setdefault("set_access_remapped_elsewhere_us", []).append(
            timed(lambda: ok(d.cuMemSetAccess(other, count * chunk, vmm.acc, 1))) * 1e6 / count)
        unmap_all(other)
    ok(d.cuMemAddressFree(base, count * chunk))
    ok(d.cuMemAddressFree(other, count * chunk))
    for h in handles:
        ok(d.cuMemRelease(h))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_set_access.json"))
    args = parser.parse_args()
    vmm = Vmm()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                              "count": args.count, "results": []}
    for chunk_mib, slice_mib in ((2, 2), (8, 8), (32, 32), (2, 32), (8, 64)):
        try:
            row = one_layout(vmm, chunk_mib * MIB, args.count, slice_mib * MIB, args.rounds)
        except Exception as exc:  # noqa: BLE001 - report and go on (offsets may be refused)
            row = {"error": repr(exc)}
        row = {"chunk_mib": chunk_mib, "handle_mib": slice_mib, **row}
        report["results"].append(row)
        print(json.dumps(row))
    with open(args.json, "w") as out:
        json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
