"""Does growing the warm reserve on another thread slow the forward passes running meanwhile?

After a reload used it, the warm reserve regrows a host run's pages (2 GiB for a 16k-token 8B
prefix) on the upkeep thread while the engine keeps stepping: a page group at a time, each one
``cuMemCreate`` of a page per KV tensor, then ``cuMemMap``, ``cuMemSetAccess`` and (fresh pages)
a zero-fill on the legacy default stream per tensor (:mod:`kvelastic.pool.cuda`). On an H200
(session 24) the request right after an idle engine's reload took 34-60 ms in 4 of 11 reps
instead of 18-25, and 18-25 in all 6 with ``KVELASTIC_RESERVE_HOST_RUNS=0``. This bench asks
the driver directly, no vLLM: a stand-in forward pass (``--kernels`` matmuls, launched one by
one as eager mode does, or replayed from a CUDA graph as vLLM's decode does) is timed step by
step while another thread grows ``--total-mib`` in groups, against the same steps alone.

Session 24 found 1-2 ms per 2 GiB with those steps, while in the engine the request beside the growth
lost 15-40 ms (and none once the growth was paced, session 25). Their matmuls keep the GPU busy with
work queued ahead, which would hide a growth that holds up the host's launches; the ``tiny`` rows
(``--tiny-kernels``) make the step the launches themselves, and their ``noop calls`` growth makes as
many driver calls of no weight, to tell the driver's work from the GIL's round trips.

    python scripts/bench_grow_beside.py --json $OUT/grow_beside.json
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


class Grower:
    """Pages for ``layers`` KV tensors grown a group (one page per tensor) at a time, as the pool does."""

    def __init__(self, backend: CudaBackend, layers: int, groups: int, page: int):
        self.backend, self.layers, self.groups, self.page = backend, layers, groups, page
        backend.use_page_size(page)
        self.ranges = [backend.reserve_address(groups * page) for _ in range(layers)]
        self.handles: list[int] = []
        self.group_ms: list[float] = []

    def grow(self, *, zero: bool, create: bool = True, map_pages: bool = True, noop_calls: int = 0) -> None:
        """``noop_calls``: instead, that many trivial driver calls a page (the GIL's round trips alone)."""
        for g in range(self.groups):
            t = time.perf_counter()
            for _ in range(self.layers * noop_calls):
                self.backend._driver.cuDriverGetVersion()
            handles = [self.backend.create_page(self.page) for _ in range(self.layers)] if create else []
            self.handles += handles
            if map_pages and handles:
                runs = [MapRun(address + g * self.page, (h,)) for address, h in zip(self.ranges, handles)]
                self.backend.map_runs(runs, self.page, zero=zero)
            self.group_ms.append((time.perf_counter() - t) * 1e3)
            time.sleep(0)

    def undo(self, mapped: bool) -> None:
        torch.cuda.synchronize()
        if mapped:
            for address in self.ranges:
                self.backend.unmap(address, self.groups * self.page)
        for h in self.handles:
            self.backend.release_page(h)
        self.handles = []
        for address in self.ranges:
            self.backend.free_address(address, self.groups * self.page)


def make_step(kernels: int, size: int, graph: bool, tiny: bool = False) -> Callable[[], None]:
    """A stand-in forward pass: ``kernels`` bf16 matmuls of ``size``, eager or one graph replay. ``tiny``:
    ``kernels`` launches of a kernel on a few KiB instead, so the step is the host launching them (as a
    short prefill's or a decode's eager parts are), and anything that holds up launches shows in full."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    small = torch.zeros(1024, device="cuda")

    def eager() -> None:
        for _ in range(kernels):
            if tiny:
                small.add_(1.0)
            else:
                torch.mm(a, b, out=out)

    if not graph:
        return eager
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eager()
    return g.replay


def step_ms(step: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def beside_growth(step: Callable[[], None], grower: Grower, how: dict) -> dict:
    """Steps while the grower works on a thread: the steps that overlapped it, and its wall time."""
    done = threading.Event()
    took: list[float] = []

    def work() -> None:
        t = time.perf_counter()
        grower.grow(**how)
        took.append((time.perf_counter() - t) * 1e3)
        done.set()

    steps: list[float] = []
    thread = threading.Thread(target=work)
    thread.start()
    while not done.is_set():
        steps += step_ms(step, 1)
    thread.join()
    return {"steps": steps, "grow_ms": took[0], "group_ms": list(grower.group_ms)}


def one_case(backend: CudaBackend, step: Callable[[], None], args: argparse.Namespace, how: dict) -> dict:
    page = args.page_mib * MIB
    groups = args.total_mib * MIB // (args.layers * page)
    alone, overlapped, grow, extra = [], [], [], []
    for _ in range(args.reps):
        base = step_ms(step, 10)
        grower = Grower(backend, args.layers, groups, page)
        got = beside_growth(step, grower, how)
        grower.undo(mapped=how.get("map_pages", True) and how.get("create", True))
        med = statistics.median(base)
        alone.append(med)
        overlapped += got["steps"]
        grow.append(got["grow_ms"])
        extra.append(sum(got["steps"]) - med * len(got["steps"]))
    return {"step_alone_ms": statistics.median(alone), "steps_beside_median_ms": statistics.median(overlapped),
            "steps_beside_max_ms": max(overlapped), "grow_ms": statistics.median(grow),
            "extra_ms_per_growth": statistics.median(extra), "steps_beside": len(overlapped)}


def python_work(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    n = 0
    while time.perf_counter() < end:
        n += sum(range(50))


def pool_case(step: Callable[[], None], args: argparse.Namespace, grow: bool) -> dict:
    """Steps that use a real pool (stats each step, a group mapped every few) beside its reserve growing."""
    from kvelastic.pool.page_pool import PagePool
    from kvelastic.pool.reserve_growth import grow_in_chunks

    page = args.page_mib * MIB
    pool = PagePool.standard(CudaBackend(torch.cuda.current_device()), page_bytes=page, zero_on_map="fresh")
    tensors = [pool.add_tensor(4096 * MIB) for _ in range(args.layers)]
    pages = args.total_mib * MIB // page
    steps, waits, grow_ms = [], [], []
    for _ in range(args.reps):
        group = iter(range(1, 1 << 20))
        done = threading.Event()

        def work() -> None:
            t = time.perf_counter()
            grow_in_chunks(pool, pages)
            grow_ms.append((time.perf_counter() - t) * 1e3)
            done.set()

        thread = threading.Thread(target=work) if grow else None
        if thread is not None:
            thread.start()
        n = 0
        while (thread is not None and not done.is_set()) or (thread is None and n < 10):
            t = time.perf_counter()
            python_work(args.python_ms)
            w = time.perf_counter()
            pool.stats()
            if n % args.map_every == 0:
                pool.map_groups([next(group)])
            waits.append((time.perf_counter() - w) * 1e3)
            step()
            torch.cuda.synchronize()
            steps.append((time.perf_counter() - t) * 1e3)
            n += 1
        if thread is not None:
            thread.join()
        torch.cuda.synchronize()
        pool.unmap_groups(sorted(pool.mapped_groups()))
        pool.collect(wait=True)
        pool.trim_reserve(0)
    del tensors
    pool.close()
    return {"step_median_ms": statistics.median(steps), "step_max_ms": max(steps),
            "pool_calls_median_ms": statistics.median(waits), "pool_calls_max_ms": max(waits),
            "grow_ms": statistics.median(grow_ms) if grow_ms else None, "steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--page-mib", type=int, default=8)
    parser.add_argument("--kernels", type=int, default=300, help="matmuls per stand-in step")
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--tiny-kernels", type=int, default=2000,
                        help="launches per launch-bound step (rows 'tiny'; 0: none, as in session 24)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--python-ms", type=float, default=3.0, help="pure-Python work per pool step")
    parser.add_argument("--map-every", type=int, default=2, help="pool steps between two group maps")
    parser.add_argument("--json")
    args = parser.parse_args()
    backend = CudaBackend(torch.cuda.current_device())
    cases = {"create+map+zero": {"zero": True}, "create+map": {"zero": False},
             "create only": {"zero": False, "map_pages": False}}
    results: dict = {"args": vars(args), "device": torch.cuda.get_device_name()}
    print(f"{'step':8} {'growth':16} {'alone':>7} {'beside':>7} {'max':>7} {'grow ms':>8} {'extra ms':>9} {'n':>4}")
    modes = ["eager", "graph"] + (["tiny"] if args.tiny_kernels else [])
    for mode in modes:
        if mode == "tiny":  # launch-bound steps; the same driver calls as a growth, but trivial ones, too
            step = make_step(args.tiny_kernels, args.size, graph=False, tiny=True)
            cases["noop calls"] = {"zero": False, "create": False, "noop_calls": 4}
        else:
            step = make_step(args.kernels, args.size, graph=mode == "graph")
        step_ms(step, 5)
        for name, how in cases.items():
            r = one_case(backend, step, args, how)
            results[f"{mode}/{name}"] = r
            print(f"{mode:8} {name:16} {r['step_alone_ms']:7.2f} {r['steps_beside_median_ms']:7.2f} "
                  f"{r['steps_beside_max_ms']:7.2f} {r['grow_ms']:8.1f} {r['extra_ms_per_growth']:9.1f} "
                  f"{r['steps_beside']:4}")
    print(f"\n{'pool step':10} {'step':>7} {'max':>7} {'pool ms':>8} {'pool max':>9} {'grow ms':>8} {'n':>4}")
    step = make_step(args.kernels, args.size, graph=True)
    for name, grow in (("alone", False), ("beside", True)):
        r = pool_case(step, args, grow)
        results[f"pool/{name}"] = r
        print(f"{name:10} {r['step_median_ms']:7.2f} {r['step_max_ms']:7.2f} {r['pool_calls_median_ms']:8.2f} "
              f"{r['pool_calls_max_ms']:9.2f} {r['grow_ms'] or 0:8.1f} {r['steps']:4}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
