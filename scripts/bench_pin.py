"""What the host tier costs engine start-up: its constructor vs pinning the same memory synchronously.

For N GiB of host tier (torch and cuda-python only, no vLLM):

- ``sync``: ``torch.empty(..., pin_memory=True)``, what the tier did before
  (the engine waited for all of it);
- ``background``: :class:`HostMemory` as the tier builds it now: the
  constructor's time (what start-up waits for), then the time until every
  chunk is pinned, and a copy round trip through both copy paths into slots
  pinned last, with a staged run that crosses a chunk boundary;
- ``--sweep-gib M``: the background variant at M GiB for each thread count,
  with and without transparent huge pages (the defaults in host_memory.py
  come from this).

    PYTHONPATH=. python3 scripts/bench_pin.py --gib 48 --sweep-gib 8 --json $OUT/pin.json

Needs N GiB of free host memory at a time (each variant is freed before the next).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvelastic.offload import host_memory
from kvelastic.offload.copier import BlockCopier
from kvelastic.offload.host_memory import CudaPinner, HostMemory

GIB = 1024 ** 3
SLOT_BYTES = 2 * 1024 * 1024  # an 8B model's block of 16 tokens over all layers


def sync_pin(nbytes: int) -> dict:
    start = time.perf_counter()
    buffer = torch.empty((nbytes // SLOT_BYTES, SLOT_BYTES), dtype=torch.int8, pin_memory=True)
    seconds = time.perf_counter() - start
    del buffer
    start = time.perf_counter()
    torch._C._host_emptyCache()  # the caching host allocator keeps freed pinned blocks
    return {"mode": "sync", "gib": nbytes / GIB, "constructor_s": seconds, "pinned_s": seconds,
            "free_s": time.perf_counter() - start}


def background_pin(nbytes: int, threads: int, hugepages: bool, check: bool) -> dict:
    slots = nbytes // SLOT_BYTES
    start = time.perf_counter()
    memory = HostMemory(slots, SLOT_BYTES, pinner=CudaPinner(), threads=threads, hugepages=hugepages)
    constructor = time.perf_counter() - start
    ready_at_return = memory.ready_slots
    stall = 0.0  # the longest the main thread (the engine's, in a real start-up) waited for the GIL
    while not memory.settled:
        t = time.perf_counter()
        time.sleep(0.001)
        stall = max(stall, time.perf_counter() - t - 0.001)
    memory.wait()
    row = {"mode": "background", "gib": nbytes / GIB, "threads": threads, "hugepages": hugepages,
           "constructor_s": constructor, "pinned_s": time.perf_counter() - start, "thread_pinned_s": memory.seconds,
           "ready_at_return_mib": ready_at_return * SLOT_BYTES / 2 ** 20, "pinned_gib": memory.pinned_bytes / GIB,
           "failure": memory.failure, "main_thread_max_stall_ms": stall * 1e3}
    if check:
        row.update(round_trips(memory))
    start = time.perf_counter()
    memory.free()
    row["free_s"] = time.perf_counter() - start
    return row


def round_trips(memory: HostMemory) -> dict:
    """Both copy paths into the last slots, and a staged run across the first chunk boundary."""
    blocks = 64
    device = torch.device("cuda")
    kv = torch.randint(-128, 127, (blocks, SLOT_BYTES), dtype=torch.int8, device=device)
    boundary = host_memory.chunk_plan(memory.slots, SLOT_BYTES)[1][1]  # end of the first background chunk
    cases = {"last": list(range(memory.slots - 8, memory.slots)), "across": list(range(boundary - 4, boundary + 4))}
    out = {}
    for path in ("direct", "staged"):
        copier = BlockCopier([kv], memory.buffer, path=path, breaks=memory.breaks)  # type: ignore[arg-type]
        for name, slots in cases.items():
            ids = list(range(len(slots)))
            torch.cuda.synchronize()
            t = time.perf_counter()
            copier.store(ids, slots).wait()
            store_s = time.perf_counter() - t
            back = list(range(blocks - len(slots), blocks))
            copier.load(back, slots).wait()
            torch.cuda.synchronize()
            exact = bool(torch.equal(kv[back], kv[ids]))
            out[f"{path}_{name}"] = {"exact": exact, "store_gbps": len(slots) * SLOT_BYTES / store_s / 1e9}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=48.0)
    p.add_argument("--sweep-gib", type=float, default=0.0, help="0: no sweep")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--no-sync", action="store_true", help="skip the synchronous baseline")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "pin.json"))
    args = p.parse_args()
    torch.cuda.init()
    rows = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    nbytes = int(args.gib * GIB) // SLOT_BYTES * SLOT_BYTES
    record(background_pin(nbytes, host_memory.THREADS, True, check=True))
    if not args.no_sync:
        record(sync_pin(nbytes))
    if args.sweep_gib:
        sweep = int(args.sweep_gib * GIB) // SLOT_BYTES * SLOT_BYTES
        record(sync_pin(sweep))
        for hugepages in (True, False):
            for threads in args.threads:
                record(background_pin(sweep, threads, hugepages, check=False))
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                   "defaults": {"threads": host_memory.THREADS, "chunk_bytes": host_memory.CHUNK_BYTES},
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
