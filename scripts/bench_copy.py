"""Spill and reload bandwidth of the host tier's copier on a GPU (no vLLM).

Builds KV tensors shaped like an 8B model's (32 layers, blocks of 16 tokens,
8 KV heads of 128 in bf16: 64 KiB per layer per block, blocks-first layout),
over the elastic page pool, and moves batches of random blocks to pinned host
slots and back. A 16k-token prefix is 1024 blocks (2 GiB).

    python scripts/bench_copy.py --json $OUT/bench_copy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvelastic.offload.copier import BlockCopier
from kvelastic.pool import PagePool
from kvelastic.pool.cuda import CudaBackend

MIB = 1024 * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-kib", type=int, default=64, help="bytes per layer per block")
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_copy.json"))
    args = p.parse_args()
    torch.cuda.init()
    block = args.block_kib * 1024
    pool = PagePool(CudaBackend(), page_bytes=8 * MIB, zero_on_map="fresh")
    raws = [pool.add_tensor(args.blocks * block) for _ in range(args.layers)]
    pool.map_groups(range(args.blocks * block // (8 * MIB)))
    views = [r.view(args.blocks, block) for r in raws]
    for i, v in enumerate(views):
        v.view(torch.bfloat16).normal_()
    host = torch.empty((max(args.batches), args.layers * block), dtype=torch.int8, pin_memory=True)
    copier = BlockCopier(views, host)
    rows = []
    print(f"{'blocks':>7} {'MiB':>8} {'spill GB/s':>11} {'reload GB/s':>12} {'reload ms':>10} {'exact':>6}")
    for batch in args.batches:
        ids = torch.randperm(args.blocks)[:batch].tolist()
        slots = list(range(batch))
        nbytes = batch * args.layers * block
        spill, load = [], []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            copier.store(ids, slots).wait()
            spill.append(time.perf_counter() - t)
            expect = torch.stack([v[ids[0]].clone() for v in views])
            target = torch.randperm(args.blocks)[:batch].tolist()
            torch.cuda.synchronize()
            t = time.perf_counter()
            copier.load(target, slots).wait()
            load.append(time.perf_counter() - t)
            exact = bool(torch.equal(torch.stack([v[target[0]] for v in views]), expect))
        row = {"blocks": batch, "bytes": nbytes, "spill_gbps": nbytes / statistics.median(spill) / 1e9,
               "reload_gbps": nbytes / statistics.median(load) / 1e9, "reload_ms": statistics.median(load) * 1e3,
               "exact": exact}
        rows.append(row)
        print(f"{batch:>7} {nbytes / MIB:>8.0f} {row['spill_gbps']:>11.1f} {row['reload_gbps']:>12.1f} "
              f"{row['reload_ms']:>10.2f} {str(exact):>6}")
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                   "layers": args.layers, "block_bytes_per_layer": block, "rows": rows}, f, indent=2)
    del views, raws
    pool.close()


if __name__ == "__main__":
    main()
