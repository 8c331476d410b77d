"""What write-through's stores cost the compute they run beside, per copy path (no vLLM).

On an H200 (session 21, multi-turn benchmark) write-through slowed the turn that loads nothing
(turn 0: prefill and decode only) by 13 % on the 1B shape and 4 % on the 8B shape, with the stores
on a stream of their own (`KVELASTIC_CPU_STORE_STREAM=own`) still by 8 % on the 1B shape. The
suspect: for scattered blocks the copier's stores are SM kernels (`direct`, `fused`) that write
host memory over PCIe and hold their SMs for as long as those writes take, beside the forward
pass. `KVELASTIC_CPU_STORE_PATH=staged` gathers into a staging buffer of the stores' own at
device-memory speed and leaves the PCIe writes to the copy engines.

This measures it without an engine. A thread runs steps of GPU work back to back on the default
stream, one in flight as an engine's (a bf16 matmul and a device-memory copy: compute and memory
traffic), each timed by CUDA events. First the steps alone; then, per configuration, the same
steps while the main thread issues `BlockCopier.store_beside` batches of scattered blocks
(`--batch` of them into consecutive slots, as the tier hands slots out) one after another for
`--seconds`. Printed as a table (median step, its slowdown, the stores' GB/s), written as JSON:

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


def beside(copier: BlockCopier, num_blocks: int, device: torch.device, args: argparse.Namespace) -> dict:
    """The steps while stores run beside them; the stores' bytes per wall second."""
    slots = list(range(args.batch))
    copier.store_beside(random.sample(range(num_blocks), args.batch), slots).wait()  # first use: allocations
    steps = Steps(args.matmul, args.copy_mib, device)
    moved = 0
    with steps:
        began = time.perf_counter()
        while time.perf_counter() - began < args.seconds:
            copier.store_beside(random.sample(range(num_blocks), args.batch), slots).wait()
            moved += args.batch * copier.bytes_per_block
        elapsed = time.perf_counter() - began
    return {"step_ms": steps.times[args.skip:], "store_gbps": moved / elapsed / 1e9}


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for shape in args.shapes:
        views = kv_views(device, shape, args.blocks)
        host = torch.zeros((args.batch, sum(v.shape[1] for v in views)), dtype=torch.int8,
                           pin_memory=device.type == "cuda")
        alone = statistics.median(steps_alone(device, args))
        rows.append({"shape": shape, "path": "-", "side_path": "-", "step_ms": alone, "slowdown": 0.0,
                     "store_gbps": 0.0})
        for path, side_path in args.configs:
            try:
                copier = BlockCopier(views, host, path=path, side_path=side_path)
            except Exception as e:  # noqa: BLE001 - e.g. fused without triton: say so, measure the rest
                print(f"{shape} {path}/{side_path}: not measured ({e})")
                continue
            got = beside(copier, args.blocks, device, args)
            step = statistics.median(got["step_ms"])
            rows.append({"shape": shape, "path": path, "side_path": side_path, "step_ms": step,
                         "slowdown": step / alone - 1, "store_gbps": got["store_gbps"],
                         "steps": len(got["step_ms"])})
            del copier
        del views, host
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':>5} {'path':>7} {'side path':>9} {'step ms':>8} {'slowdown':>9} {'stores GB/s':>11}")
    for r in rows:
        print(f"{r['shape']:>5} {r['path']:>7} {r['side_path']:>9} {r['step_ms']:8.3f} "
              f"{100 * r['slowdown']:8.1f}% {r['store_gbps']:11.1f}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=list(SHAPES))
    p.add_argument("--configs", nargs="+", default=[f"{a}/{b}" for a, b in CONFIGS], metavar="PATH/SIDE_PATH",
                   help="copy path and side path of each configuration (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=2048, help="KV blocks per shape (8B: 2 MiB each)")
    p.add_argument("--batch", type=int, default=32, help="blocks per store (scattered ids, consecutive slots)")
    p.add_argument("--seconds", type=float, default=3.0, help="per configuration, and for the steps alone")
    p.add_argument("--matmul", type=int, default=4096, help="square bf16 matmul of each step")
    p.add_argument("--copy-mib", type=int, default=256, help="device-memory copy of each step")
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
