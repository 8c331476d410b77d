"""Do the driver's page maps on one thread delay kernel launches on another (no vLLM)?

``bench_vmm_map.py`` found that cuMemMap + cuMemSetAccess on another thread wait while SM
copy kernels run (48.6 ms for 2 GiB beside them, 8.7 alone). kvelastic maps beside a serving
engine's steps in several places: a rank's maps after its forward's launch,
the warm reserve's growth on the idle threads, the mapper
thread of a one-GPU engine. If a map that waits for running kernels also holds a driver lock
that the launching thread needs, each such map stalls the next step's launches: a cost no CPU
model sees (TP=4 on 4 x H200 ran its warm pass at 0.907x vanilla, 2026-11-28).

The launching thread mimics a step: one long kernel (a matmul of ``--matmul`` square bf16, a
few ms of GPU work), then ``--small`` small kernels whose launch CPU time is measured. The
other thread maps and unmaps ``--map-mib`` of 8 MiB pages in a loop. Reported: the launches'
CPU time per step (median, p99) alone and beside the maps, and the maps' time alone and beside
the steps.

    python scripts/bench_launch_beside_maps.py --json $OUT/launch_beside_maps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from kvelastic.pool.backend import MapRun
from kvelastic.pool.cuda import CudaBackend

MIB = 1024 * 1024
PAGE = 8 * MIB


def steps(count: int, matmul: int, small: int) -> list[float]:
    """CPU ms spent launching each step's small kernels, behind each step's long kernel."""
    a = torch.randn(matmul, matmul, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(256 * 1024, device="cuda")
    took = []
    for _ in range(count):
        torch.mm(a, a)
        t = time.perf_counter()
        for _ in range(small):
            x.add_(1.0)
        took.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()  # one step in flight, as an engine's: the launch queue never fills
    return took


class Mapper:
    """Maps and unmaps one run of pages until stopped; records each map's wall time."""

    def __init__(self, backend: CudaBackend, nbytes: int):
        self.backend, self.nbytes = backend, nbytes
        backend.use_page_size(PAGE)
        self.address = backend.reserve_address(nbytes)
        self.handles = tuple(backend.create_page(PAGE) for _ in range(nbytes // PAGE))
        self.maps: list[float] = []
        self.stop = threading.Event()

    def once(self) -> None:
        t = time.perf_counter()
        self.backend.map_runs([MapRun(self.address, self.handles)], PAGE, zero=False)
        self.maps.append((time.perf_counter() - t) * 1e3)
        self.backend.unmap(self.address, self.nbytes)

    def loop(self) -> None:
        while not self.stop.is_set():
            self.once()

    def close(self) -> None:
        for handle in self.handles:
            self.backend.release_page(handle)
        self.backend.free_address(self.address, self.nbytes)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p99": ordered[int(0.99 * (len(ordered) - 1))],
            "count": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--matmul", type=int, default=8192)
    parser.add_argument("--small", type=int, default=50)
    parser.add_argument("--map-mib", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    backend = CudaBackend(torch.cuda.current_device())
    mapper = Mapper(backend, args.map_mib * MIB)
    steps(20, args.matmul, args.small)  # warm up cuBLAS and the allocator
    for _ in range(20):
        mapper.once()
    maps_alone = summary(mapper.maps)
    mapper.maps = []
    alone = summary(steps(args.steps, args.matmul, args.small))
    thread = threading.Thread(target=mapper.loop)
    thread.start()
    beside = summary(steps(args.steps, args.matmul, args.small))
    mapper.stop.set()
    thread.join()
    maps_beside = summary(mapper.maps)
    mapper.close()
    result = {"device": torch.cuda.get_device_name(), "args": vars(args), "launches_alone_ms": alone,
              "launches_beside_maps_ms": beside, "maps_alone_ms": maps_alone, "maps_beside_steps_ms": maps_beside}
    print(f"launch CPU per step ({args.small} small kernels behind a {args.matmul}^2 matmul), ms:")
    print(f"  alone         median {alone['median']:.3f}  p99 {alone['p99']:.3f}")
    print(f"  beside maps   median {beside['median']:.3f}  p99 {beside['p99']:.3f}")
    print(f"map of {args.map_mib} MiB, ms: alone {maps_alone['median']:.2f}, beside the steps "
          f"{maps_beside['median']:.2f} (p99 {maps_beside['p99']:.2f}, {maps_beside['count']} maps)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
