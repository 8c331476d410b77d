"""Does regrowing the warm reserve hold up a map the scheduler waits for, or the GPU's kernels? (no vLLM)

Session 19 (H200): on a busy engine the GPU hit right after a 16k-token 8B reload took ~59 ms in
six of nine reps instead of ~22. Right after the reload used the reserve for host runs, the upkeep
regrew it: 2 GiB of pages created and mapped ahead in one ``PagePool.grow_reserve`` call, which
holds the pool's lock throughout, while a map the scheduler waits for (the mapper thread's) takes
the same lock. Since 3980bde the reserve grows a page group per call
(:mod:`kvelastic.pool.reserve_growth`). Two causes fit what was seen, and this separates them:

- *the lock*: the map waits for the whole growth (one call) or one chunk (chunks);
- *the driver or the GPU*: the growth's cuMemMap/cuMemSetAccess slow the kernels themselves, or
  the map, whatever the lock does.

A pool over the CUDA driver like an 8B engine's (``--tensors`` KV tensors of 8 MiB pages: a page
group of 256 MiB) while a thread runs steps of GPU work back to back (``--matmul`` square bf16,
each step timed by CUDA events). Per trial, a thread grows ``--grow-mib`` of reserve, as one
call or in chunks, and ``--delay-ms`` after it starts this thread maps one far group, as the
mapper would: its wall time is the wait. Baselines: the map alone, the growth alone, the steps
alone. Printed as a table, written as JSON::

    python scripts/bench_reserve_growth.py --json $OUT/reserve_growth.json

``--backend host`` runs the same trials over host memory (no kernels): a smoke test on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any, Callable

import torch

from kvelastic.pool import HostBackend, PagePool
from kvelastic.pool.reserve_growth import grow_in_chunks
from gpu_steps import Steps  # beside this file

MIB = 1024 * 1024
PAGE = 8 * MIB


def timed(call: Callable[[], Any]) -> float:
    t = time.perf_counter()
    call()
    return (time.perf_counter() - t) * 1e3


def reset(pool: PagePool, far_group: int) -> None:
    """Back to no reserve and the far group unmapped, its pages given back to the device."""
    pool.unmap_groups([far_group])
    pool.collect(wait=True)
    pool.trim_reserve(0)


def trial(pool: PagePool, grow: Callable[[], Any], far_group: int, delay_ms: float) -> dict[str, float]:
    """Grow on a thread; ``delay_ms`` later map ``far_group`` here. Wall ms of both."""
    took: dict[str, float] = {}
    grower = threading.Thread(target=lambda: took.__setitem__("grow_ms", timed(grow)))
    grower.start()
    time.sleep(delay_ms / 1e3)
    took["map_wait_ms"] = timed(lambda: pool.map_groups([far_group]))
    grower.join()
    reset(pool, far_group)
    return took


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "max": ordered[-1], "count": len(ordered)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    on_cuda = args.backend == "cuda"
    backend = _cuda_backend() if on_cuda else HostBackend()
    pool = PagePool.standard(backend, page_bytes=PAGE, zero_on_map="fresh")
    tensors = [pool.add_tensor(args.groups * PAGE) for _ in range(args.tensors)]
    far_group = args.groups - 1
    pages = args.grow_mib * MIB // PAGE
    modes = {"one call": lambda: pool.grow_reserve(pages), "chunks": lambda: grow_in_chunks(pool, pages)}
    result: dict[str, Any] = {"args": vars(args), "device": torch.cuda.get_device_name() if on_cuda else "host"}
    for _ in range(3):  # warm-up: the driver's first calls, the allocator
        trial(pool, modes["one call"], far_group, args.delay_ms)
    result["map_alone_ms"] = summary([_map_alone(pool, far_group) for _ in range(args.trials)])
    result["grow_alone_ms"] = {name: summary([_grow_alone(pool, grow) for _ in range(args.trials)])
                               for name, grow in modes.items()}
    if on_cuda:
        with Steps(args.matmul) as steps:
            time.sleep(0.2)
            result["step_alone_gpu_ms"] = summary(list(steps.times))
            for name, grow in modes.items():
                before = len(steps.times)
                trials = [trial(pool, grow, far_group, args.delay_ms) for _ in range(args.trials)]
                result[f"beside steps, {name}"] = {
                    "grow_ms": summary([t["grow_ms"] for t in trials]),
                    "map_wait_ms": summary([t["map_wait_ms"] for t in trials]),
                    "step_gpu_ms": summary(steps.times[before:])}
    else:
        for name, grow in modes.items():
            trials = [trial(pool, grow, far_group, args.delay_ms) for _ in range(args.trials)]
            result[f"no steps, {name}"] = {"grow_ms": summary([t["grow_ms"] for t in trials]),
                                           "map_wait_ms": summary([t["map_wait_ms"] for t in trials])}
    del tensors
    pool.close()
    return result


def _cuda_backend() -> Any:
    from kvelastic.pool.cuda import CudaBackend

    return CudaBackend(torch.cuda.current_device())


def _map_alone(pool: PagePool, far_group: int) -> float:
    took = timed(lambda: pool.map_groups([far_group]))
    reset(pool, far_group)
    return took


def _grow_alone(pool: PagePool, grow: Callable[[], Any]) -> float:
    took = timed(grow)
    pool.trim_reserve(0)
    return took


def print_table(result: dict[str, Any]) -> None:
    args = result["args"]
    print(f"{result['device']}: {args['tensors']} tensors of 8 MiB pages, growth {args['grow_mib']} MiB, "
          f"map of one group {args['delay_ms']} ms into it; medians (max) of {args['trials']} trials, ms")
    print(f"  map alone {result['map_alone_ms']['median']:.2f}; growth alone: "
          + ", ".join(f"{k} {v['median']:.2f}" for k, v in result["grow_alone_ms"].items()))
    if "step_alone_gpu_ms" in result:
        print(f"  step alone (GPU) {result['step_alone_gpu_ms']['median']:.3f}")
    for key, row in result.items():
        if isinstance(row, dict) and "map_wait_ms" in row:
            line = (f"  {key:<22} map waits {row['map_wait_ms']['median']:8.2f} ({row['map_wait_ms']['max']:.2f})"
                    f"  growth {row['grow_ms']['median']:8.2f}")
            if "step_gpu_ms" in row:
                line += f"  step (GPU) {row['step_gpu_ms']['median']:.3f} ({row['step_gpu_ms']['max']:.3f})"
            print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--tensors", type=int, default=32, help="KV tensors (8B: 32 layers)")
    parser.add_argument("--groups", type=int, default=24, help="page groups each tensor spans")
    parser.add_argument("--grow-mib", type=int, default=2048, help="reserve grown per trial (a 16k 8B run: 2 GiB)")
    parser.add_argument("--delay-ms", type=float, default=1.0, help="the map starts this long after the growth")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--matmul", type=int, default=8192, help="each step's square bf16 matmul")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.grow_mib * MIB // PAGE > (args.groups - 1) * args.tensors:
        parser.error("--grow-mib must fit in the groups below the far one")
    result = run(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
