"""Spill and reload bandwidth of the host tier's copier on a GPU (no vLLM), per copy path.

Builds KV tensors shaped like vLLM's FlashAttention cache over the elastic page
pool: per layer a K run and a V run per block (8B shape: 32 layers, blocks of
16 tokens, 8 KV heads of 128 in bf16, 32 KiB per run; 1B shape: 16 layers,
heads of 64, 16 KiB per run). Moves batches of random blocks to host slots and
back, through each copy path, with the slots consecutive (as the host tier
hands them out) or scattered. A 16k-token 8B prefix is 1024 blocks (2 GiB).

The host side is, per ``--host``, torch's pinned allocation (``torch``, what the
tier used before it pinned in the background) or the tier's own buffer
(``tier``: one mmap registered with the driver chunk by chunk, :class:`HostMemory`,
copies ending at chunk starts). The multi-turn A/B of 2026-11-27 found the tier
9 % slower than a tree that still used torch's allocation: ``--host torch tier``
shows whether the buffer is why.

    python scripts/bench_copy.py --host torch tier --json $OUT/bench_copy.json

``--paths direct fused`` sets the fused path (one Triton kernel per batch,
issue #16) beside the direct one; ``--fused-tiles 4096x4 8192x8`` measures it
once per chunk size (bytes one program copies of a piece) and warp count.

``--paths direct runs`` sets the runs path (runs of consecutive blocks to
consecutive slots on the copy engines, the rest direct) beside the direct one.
Only the ``contiguous`` layout (consecutive block ids to consecutive slots, as a
spilled prefix comes back) has runs; ``run_share`` in each row is the fraction of
blocks that went as runs. ``--run-min-blocks 4 16 64`` measures the path once
per shortest run (``run_copy.MIN_RUN_BLOCKS`` by default):

    python scripts/bench_copy.py --paths direct runs --shapes 8b 1b --json $OUT/bench_copy_runs.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from kvelastic.offload.block_columns import BlockColumns
from kvelastic.offload.copier import BlockCopier
from kvelastic.offload.fused_copy import CHUNK_BYTES as FUSED_CHUNK_BYTES, NUM_WARPS, FusedCopy
from kvelastic.offload.host_memory import CHUNK_BYTES, CudaPinner, HostMemory
from kvelastic.offload.host_tier import allocate_slots
from kvelastic.offload.run_copy import MIN_RUN_BLOCKS, RunCopy
from kvelastic.pool import PagePool
from kvelastic.pool.cuda import CudaBackend

MIB = 1024 * 1024
SHAPES = {"8b": (32, 32), "1b": (16, 16)}  # layers, KiB per K (or V) run of a block


def pick_blocks(num_blocks: int, batch: int, contiguous: bool) -> list[int]:
    """``batch`` random block ids, or ``batch`` consecutive ones from a random start."""
    if not contiguous:
        return random.sample(range(num_blocks), batch)
    first = random.randrange(num_blocks - batch + 1)
    return list(range(first, first + batch))


def measure(copier: BlockCopier, views: list[torch.Tensor], num_blocks: int, batch: int, slots: list[int],
            reps: int, contiguous: bool = False) -> dict:
    nbytes = batch * copier.bytes_per_block
    spill, load, exact = [], [], True
    moved = dict(getattr(copier.mover, "moved", {}))
    for _ in range(reps):
        ids = pick_blocks(num_blocks, batch, contiguous)
        torch.cuda.synchronize()
        t = time.perf_counter()
        copier.store(ids, slots).wait()
        spill.append(time.perf_counter() - t)
        expect = torch.cat([v[ids[-1]] for v in views])
        target = pick_blocks(num_blocks, batch, contiguous)
        torch.cuda.synchronize()
        t = time.perf_counter()
        copier.load(target, slots).wait()
        load.append(time.perf_counter() - t)
        exact &= bool(torch.equal(torch.cat([v[target[-1]] for v in views]), expect))
    row = {"blocks": batch, "bytes": nbytes, "spill_gbps": nbytes / statistics.median(spill) / 1e9,
           "reload_gbps": nbytes / statistics.median(load) / 1e9, "reload_ms": statistics.median(load) * 1e3,
           "exact": exact}
    if moved:  # the runs path: which share of the blocks went to the copy engines
        after = copier.mover.moved  # type: ignore[union-attr]
        runs, direct = after["runs"] - moved["runs"], after["direct"] - moved["direct"]
        row["run_share"] = runs / max(1, runs + direct)
    return row


HOSTS = ("torch", "tier", "tier-one", "tier-4k")
LAYOUTS = ("runs", "scattered", "contiguous")
DEFAULT_TILE = f"{FUSED_CHUNK_BYTES}x{NUM_WARPS}"


def host_buffer(kind: str, slots: int, slot_bytes: int) -> HostMemory:
    """The host tier's memory as ``KVELASTIC_CPU_PIN`` makes it (``torch``: at-start; ``tier``: background),
    all of it pinned. Two variants of ``tier`` tell its parts apart: ``tier-one`` registers everything
    after the first chunk in one call, ``tier-4k`` leaves out the transparent-huge-page advice."""
    if kind in ("tier-one", "tier-4k"):
        memory = HostMemory(slots, slot_bytes, pinner=CudaPinner(),
                            chunk_bytes=1 << 50 if kind == "tier-one" else CHUNK_BYTES, hugepages=kind != "tier-4k")
    else:
        memory = allocate_slots(slots, slot_bytes, pin=True, at_start=kind == "torch")
    memory.wait()
    if memory.ready_slots < slots:
        raise SystemExit(f"the tier's buffer pinned {memory.ready_slots} of {slots} slots: {memory.failure}")
    return memory


def copiers(views: list[torch.Tensor], memory: HostMemory, path: str, tiles: list[str], min_runs: list[int]):
    """(label, copier) per variant of ``path``: one per ``CHUNKxWARPS`` tile for ``fused``, one per shortest
    run for ``runs``, else just one."""
    copier = BlockCopier(views, memory.buffer, path=path, breaks=memory.breaks)  # type: ignore[arg-type]
    if path == "runs":
        for min_blocks in min_runs:
            copier.mover = RunCopy(BlockColumns.of(views, memory.buffer), memory.buffer, copier.device,
                                   memory.breaks, min_blocks=min_blocks)
            yield f"runs:{min_blocks}" if min_runs != [MIN_RUN_BLOCKS] else "runs", copier
        return
    if path != "fused":
        yield path, copier
        return
    for tile in tiles:
        chunk, warps = (int(n) for n in tile.split("x"))
        copier.mover = FusedCopy(BlockColumns.of(views, memory.buffer), memory.buffer, copier.device,
                                 chunk_bytes=chunk, num_warps=warps)
        yield f"fused:{tile}" if tiles != [DEFAULT_TILE] else "fused", copier


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--paths", nargs="+", default=["staged", "direct", "fused", "runs"],
                   choices=["staged", "direct", "fused", "runs"])
    p.add_argument("--fused-tiles", nargs="+", default=[DEFAULT_TILE], metavar="CHUNKxWARPS",
                   help=f"fused kernel variants: bytes per program and warps (default {DEFAULT_TILE})")
    p.add_argument("--run-min-blocks", nargs="+", type=int, default=[MIN_RUN_BLOCKS], metavar="N",
                   help=f"runs path variants: the shortest run sent to the copy engines (default {MIN_RUN_BLOCKS})")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                   help="runs: consecutive slots, random blocks; scattered: neither; contiguous: consecutive "
                        "block ids to consecutive slots (the only one with runs for the runs path)")
    p.add_argument("--host", nargs="+", default=["torch"], choices=HOSTS)
    p.add_argument("--host-gib", type=float, default=0,
                   help="host buffer size (default: twice the largest batch); scattered slots span all of it")
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_copy.json"))
    args = p.parse_args()
    torch.cuda.init()
    random.seed(0)
    rows = []
    print(f"{'host':>8} {'shape':>5} {'path':>14} {'slots':>10} {'blocks':>7} {'MiB':>7} {'spill GB/s':>11} "
          f"{'reload GB/s':>12} {'reload ms':>10} {'exact':>6}")
    for shape in args.shapes:
        layers, run_kib = SHAPES[shape]
        run = run_kib * 1024
        pool = PagePool.standard(CudaBackend(), page_bytes=8 * MIB, zero_on_map="fresh")
        raws = [pool.add_tensor(args.blocks * 2 * run) for _ in range(layers)]
        pool.map_groups(range(args.blocks * 2 * run // (8 * MIB)))
        views = [torch.as_strided(r, (args.blocks, run), (run, 1), half * args.blocks * run)
                 for r in raws for half in (0, 1)]  # K runs, then V runs, as FlashAttention lays them out
        for r in raws:
            r.view(torch.bfloat16).normal_()
        capacity = max(2 * max(args.batches), int(args.host_gib * 1024 * MIB) // (len(views) * run))
        for kind in args.host:
            memory = host_buffer(kind, capacity, len(views) * run)
            for label, copier in (c for path in args.paths
                                  for c in copiers(views, memory, path, args.fused_tiles, args.run_min_blocks)):
                for layout in args.layouts:
                    for batch in args.batches:
                        slots = random.sample(range(capacity), batch) if layout == "scattered" else list(range(batch))
                        row = {"host": kind, "shape": shape, "path": label, "slots": layout,
                               **measure(copier, views, args.blocks, batch, slots, args.reps, layout == "contiguous")}
                        rows.append(row)
                        print(f"{kind:>8} {shape:>5} {label:>14} {layout:>10} {batch:>7} {row['bytes'] / MIB:>7.0f} "
                              f"{row['spill_gbps']:>11.1f} {row['reload_gbps']:>12.1f} {row['reload_ms']:>10.2f} "
                              f"{str(row['exact']):>6}"
                              + (f" {row['run_share']:>5.0%} runs" if "run_share" in row else ""))
                del copier
            torch.cuda.synchronize()
            memory.free()
        del views, raws
        torch.cuda.synchronize()
        pool.close()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": rows},
                  f, indent=2)


if __name__ == "__main__":
    main()
