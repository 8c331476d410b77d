"""What making the pages of a long host run costs, and whether it can hide behind the copy.

An idle engine's 16k-token 8B reload (2 GiB) creates and maps every page of the run
before its copy starts: about 30 ms more than a busy engine's reload into warm pages
(docs/offload.md item 6). This bench takes that apart on the GPU, no vLLM:

- ``create``: cuMemCreate of the run's pages on one thread, then split over N threads
  (the driver may serialise them; cuda-python releases the GIL in its calls);
- ``map``: cuMemMap of every page and one cuMemSetAccess per layer range (the pool's
  way), with and without the zero-fill;
- ``copy``: the run's bytes from pinned host memory to the device on a side stream,
  alone, then while another thread creates pages, then while another thread maps
  already created pages (does either slow the copy, or wait for it?);
- ``release``: unmap and release, for the give-back side.

    python scripts/bench_vmm_map.py --json $OUT/vmm_map.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Callable

import torch

from kvelastic.pool.backend import MapRun
from kvelastic.pool.cuda import CudaBackend

MIB = 1024 * 1024


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


class Run:
    """A reload's pages: ``layers`` VA ranges of ``per_layer`` pages of ``page`` bytes."""

    def __init__(self, backend: CudaBackend, layers: int, per_layer: int, page: int):
        self.backend, self.layers, self.per_layer, self.page = backend, layers, per_layer, page
        backend.use_page_size(page)
        self.ranges = [backend.reserve_address(per_layer * page) for _ in range(layers)]
        self.handles: list[int] = []

    def create(self, threads: int) -> None:
        count = self.layers * self.per_layer
        out: list[list[int]] = [[] for _ in range(threads)]

        def work(i: int) -> None:
            out[i] = [self.backend.create_page(self.page) for _ in range(i, count, threads)]

        if threads == 1:
            work(0)
        else:
            pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        self.handles = [h for part in out for h in part]

    def map(self, zero: bool) -> None:
        runs = [MapRun(address, tuple(self.handles[i * self.per_layer:(i + 1) * self.per_layer]))
                for i, address in enumerate(self.ranges)]
        self.backend.map_runs(runs, self.page, zero=zero)

    def unmap(self) -> None:
        for address in self.ranges:
            self.backend.unmap(address, self.per_layer * self.page)

    def release(self) -> None:
        for handle in self.handles:
            self.backend.release_page(handle)
        self.handles = []

    def close(self) -> None:
        for address in self.ranges:
            self.backend.free_address(address, self.per_layer * self.page)


def copy_ms(host: torch.Tensor, device: torch.Tensor, stream: torch.cuda.Stream, pieces: int) -> float:
    """The host->device copy of ``host`` in ``pieces`` chunks, by CUDA events on ``stream``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for h, d in zip(host.chunk(pieces), device.chunk(pieces)):
            d.copy_(h, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


class PieceCopies:
    """A reload's bytes laid out as the host tier keeps them: one row per block, every
    piece (a layer's K or V run) side by side; on the device each piece's blocks back to back.

    ``sm``: gather/scatter kernels reading the pinned rows over PCIe (the copier's ``direct``
    path); ``dma2d``: one strided copy-engine transfer per piece (cuMemcpy2DAsync)."""

    def __init__(self, total: int, pieces: int, piece_bytes: int):
        from kvelastic.offload.direct_copy import _HostArrayInterface
        from kvelastic.pool import cuda_driver

        self.driver = cuda_driver.driver()
        self.pieces, self.piece = pieces, piece_bytes
        self.row = pieces * piece_bytes
        self.blocks = total // self.row
        self.host = torch.empty(self.blocks, self.row, dtype=torch.uint8).pin_memory()
        self.host.view(torch.int64).random_()
        self.seen = torch.as_tensor(_HostArrayInterface(self.host), device="cuda").view(self.blocks, self.row)
        self.device = torch.empty(pieces, self.blocks, piece_bytes, dtype=torch.uint8, device="cuda")
        self.index = torch.arange(self.blocks, device="cuda")

    def sm(self) -> None:
        rows = self.seen.view(torch.int64)
        width = self.piece // 8
        for p in range(self.pieces):
            self.device[p].view(torch.int64).index_copy_(0, self.index, rows[:, p * width:(p + 1) * width]
                                                         .index_select(0, self.index))

    def dma2d(self, stream: torch.cuda.Stream) -> None:
        d = self.driver
        for p in range(self.pieces):
            c = d.CUDA_MEMCPY2D()
            c.srcMemoryType = d.CUmemorytype.CU_MEMORYTYPE_HOST
            c.srcHost = self.host.data_ptr() + p * self.piece
            c.srcPitch = self.row
            c.dstMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
            c.dstDevice = self.device[p].data_ptr()
            c.dstPitch = self.piece
            c.WidthInBytes = self.piece
            c.Height = self.blocks
            err, = d.cuMemcpy2DAsync(c, stream.cuda_stream)
            assert int(err) == 0, err

    def exact(self) -> bool:
        back = self.device.permute(1, 0, 2).reshape(self.blocks, self.row).cpu()
        return bool(torch.equal(back, self.host))

    def timed(self, how: str, stream: torch.cuda.Stream) -> float:
        self.device.zero_()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            self.sm() if how == "sm" else self.dma2d(stream)
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end)


def beside(copy: Callable[[], float], other: Callable[[], object]) -> tuple[float, float]:
    """Run ``other`` on a thread while ``copy`` runs here; (copy ms, other's wall ms)."""
    took: list[float] = []
    thread = threading.Thread(target=lambda: took.append(timed(other)))
    thread.start()
    ms = copy()
    thread.join()
    return ms, took[0]


def one_page_size(backend: CudaBackend, page: int, total: int, layers: int, reps: int,
                  threads: list[int], piece_bytes: int) -> dict:
    per_layer = total // layers // page
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    copy = lambda: copy_ms(host, device, stream, layers)  # noqa: E731
    copy()
    pieces = PieceCopies(total, 2 * layers, piece_bytes)
    for how in ("sm", "dma2d"):
        pieces.timed(how, stream)
    exact: list[bool] = []
    rows: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    for _ in range(reps):
        for n in threads:
            run = Run(backend, layers, per_layer, page)
            note(f"create x{n} threads", timed(lambda: run.create(n)))
            if n == 1:
                note("map + access", timed(lambda: run.map(zero=False)))
                note("unmap", timed(run.unmap))
                note("map + access + zero", timed(lambda: run.map(zero=True)))
                torch.cuda.synchronize()
                run.unmap()
            note(f"release x{n}", timed(run.release))
            run.close()
        note("copy alone", copy())
        run = Run(backend, layers, per_layer, page)
        ms, other = beside(copy, lambda: run.create(1))
        note("copy beside create", ms)
        note("create beside copy", other)
        ms, other = beside(copy, lambda: run.map(zero=False))
        note("copy beside map", ms)
        note("map beside copy", other)
        run.unmap()
        run.release()
        run.close()
        for how in ("sm", "dma2d"):
            rows_copy = lambda: pieces.timed(how, stream)  # noqa: E731
            note(f"{how} pieces alone", rows_copy())
            run = Run(backend, layers, per_layer, page)
            run.create(1)
            ms, other = beside(rows_copy, lambda: run.map(zero=False))
            note(f"{how} pieces beside map", ms)
            note(f"map beside {how}", other)
            exact.append(pieces.exact())
            run.unmap()
            run.release()
            run.close()
    rows["exact"] = [float(all(exact))]
    return {name: statistics.median(v) for name, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--page-mib", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--piece-kib", type=int, default=32, help="a block's K (or V) run in one layer (8B: 32)")
    parser.add_argument("--json")
    args = parser.parse_args()
    backend = CudaBackend(torch.cuda.current_device())
    torch.cuda.init()
    result = {"device": torch.cuda.get_device_name(), "total_mib": args.total_mib, "layers": args.layers,
              "reps": args.reps, "by_page_mib": {}}
    for page_mib in args.page_mib:
        medians = one_page_size(backend, page_mib * MIB, args.total_mib * MIB, args.layers, args.reps,
                                args.threads, args.piece_kib * 1024)
        result["by_page_mib"][page_mib] = medians
        print(f"\n{args.total_mib} MiB in {args.layers} ranges of {page_mib} MiB pages "
              f"(medians of {args.reps}, ms):")
        for name, ms in medians.items():
            print(f"  {name:<24} {ms:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
