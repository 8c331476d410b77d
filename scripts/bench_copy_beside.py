"""What copies beside compute cost the compute, per copy path (no vLLM).

On an H200 (session 21, multi-turn benchmark) write-through slowed the turn that loads nothing
(turn 0: prefill and decode only) by 13 % on the 1B shape and 4 % on the 8B shape, with the stores
on a stream of their own (`KVELASTIC_CPU_STORE_STREAM=own`) still by 8 % on the 1B shape. The
suspect: for scattered blocks the copier's copies are SM kernels (`direct`, `fused`) that write
(or read) host memory over PCIe and hold their SMs for as long as that takes, beside the forward
pass; asynchronous loads run beside compute too. `KVELASTIC_CPU_STORE_PATH=staged` and
`KVELASTIC_CPU_LOAD_PATH=staged` give those copies a staging buffer of their own: the SMs only
gather (or scatter) at device-memory speed, and the copy engines cross PCIe.

This measures it without an engine. A thread runs steps of GPU work back to back on the default
stream, one in flight as an engine's (a bf16 matmul and a device-memory copy: compute and memory
traffic), each timed by CUDA events. First the steps alone; then, per configuration and direction,
the same steps while the main thread issues batches of scattered blocks (`--batch` of them, slots
consecutive, as the tier hands slots out) one after another for `--seconds`: write-through stores
(`store_beside`) or asynchronous loads (`load(block_compute=False)`). Printed as a table (median
step, its slowdown, the copies' GB/s), written as JSON:

    python scripts/bench_copy_beside.py --json $OUT/copy_beside.json

`--device cpu` runs the same loop on the CPU (no streams: a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvelastic.offload.copier import BlockCopier
from gpu_steps import Steps  # beside this file

MIB = 1024 * 1024
SHAPES = {"8b": (32, 32), "1b": (16, 16)}  # layers, KiB per K (or V) run of a block
CONFIGS = (("direct", "same"), ("fused", "same"), ("direct", "staged"))


def kv_views(device: torch.device, shape: str, num_blocks: int) -> list[torch.Tensor]:
    """Per layer a K run and a V run of each block, as vLLM's FlashAttention cache lays them out."""
    layers, kib = SHAPES[shape]
    piece = kib * 1024
    views = []
    for _ in range(layers):
        layer = torch.randint(-128, 127, (num_blocks, 2 * piece), dtype=torch.int8, device=device)
        views += [layer[:, :piece], layer[:, piece:]]
    return views


def steps_alone(device: torch.device, args: argparse.Namespace) -> list[float]:
    steps = Steps(args.matmul, args.copy_mib, device)
    with steps:
        time.sleep(args.seconds)
    return steps.times[args.skip:]


def copy_beside(copier: BlockCopier, direction: str, num_blocks: int, batch: int) -> None:
    """One batch nothing waits for: a write-through store on the side stream, or an asynchronous load."""
    blocks, slots = random.sample(range(num_blocks), batch), list(range(batch))
    fence = (copier.store_beside(blocks, slots) if direction == "store"
             else copier.load(blocks, slots, block_compute=False))
    fence.wait()


def beside(copier: BlockCopier, direction: str, num_blocks: int, device: torch.device,
           args: argparse.Namespace) -> dict:
    """The steps while copies run beside them, one batch after another; the copies' bytes per wall second."""
    copy_beside(copier, direction, num_blocks, args.batch)  # first use: allocations
    steps = Steps(args.matmul, args.copy_mib, device)
    moved = 0
    with steps:
        began = time.perf_counter()
        while time.perf_counter() - began < args.seconds:
            copy_beside(copier, direction, num_blocks, args.batch)
            moved += args.batch * copier.bytes_per_block
        elapsed = time.perf_counter() - began
    return {"step_ms": steps.times[args.skip:], "copy_gbps": moved / elapsed / 1e9}


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for shape in args.shapes:
        views = kv_views(device, shape, args.blocks)
        host = torch.zeros((args.batch, sum(v.shape[1] for v in views)), dtype=torch.int8,
                           pin_memory=device.type == "cuda")
        alone = statistics.median(steps_alone(device, args))
        rows.append({"shape": shape, "copy": "-", "path": "-", "beside_path": "-", "step_ms": alone,
                     "slowdown": 0.0, "copy_gbps": 0.0})
        for path, beside_path in args.configs:
            try:
                copier = BlockCopier(views, host, path=path, side_path=beside_path, async_load_path=beside_path)
            except Exception as e:  # noqa: BLE001 - e.g. fused without triton: say so, measure the rest
                print(f"{shape} {path}/{beside_path}: not measured ({e})")
                continue
            for direction in args.directions:
                got = beside(copier, direction, args.blocks, device, args)
                step = statistics.median(got["step_ms"])
                rows.append({"shape": shape, "copy": direction, "path": path, "beside_path": beside_path,
                             "step_ms": step, "slowdown": step / alone - 1, "copy_gbps": got["copy_gbps"],
                             "steps": len(got["step_ms"])})
            del copier
        del views, host
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':>5} {'copy':>5} {'path':>7} {'beside':>7} {'step ms':>8} {'slowdown':>9} {'copy GB/s':>9}")
    for r in rows:
        print(f"{r['shape']:>5} {r['copy']:>5} {r['path']:>7} {r['beside_path']:>7} {r['step_ms']:8.3f} "
              f"{100 * r['slowdown']:8.1f}% {r['copy_gbps']:9.1f}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=list(SHAPES))
    p.add_argument("--configs", nargs="+", default=[f"{a}/{b}" for a, b in CONFIGS], metavar="PATH/BESIDE_PATH",
                   help="copy path, and the path of the copies beside compute (KVELASTIC_CPU_STORE_PATH and "
                        "KVELASTIC_CPU_LOAD_PATH) of each configuration (default: %(default)s)")
    p.add_argument("--directions", nargs="+", default=["store", "load"], choices=["store", "load"],
                   help="write-through stores on their own stream, asynchronous loads on the copy stream")
    p.add_argument("--blocks", type=int, default=2048, help="KV blocks per shape (8B: 2 MiB each)")
    p.add_argument("--batch", type=int, default=32, help="blocks per copy (scattered ids, consecutive slots)")
    p.add_argument("--seconds", type=float, default=3.0, help="per configuration, and for the steps alone")
    p.add_argument("--matmul", type=int, default=8192, help="square bf16 matmul of each step (some 2 ms on an H200 by its peak rate; not measured)")
    p.add_argument("--copy-mib", type=int, default=512, help="device-memory copy of each step")
    p.add_argument("--skip", type=int, default=5, help="first steps of each run left out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json")
    args = p.parse_args()
    args.configs = [tuple(c.split("/", 1)) for c in args.configs]
    return args


def main() -> None:
    args = parse_args()
    rows = run(args)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "configs"},
                       "configs": args.configs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
