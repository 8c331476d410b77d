"""The runs copy path on a real GPU: copy-engine transfers byte for byte what the direct path moves, over
VMM pages and the tier's own memory; and whether a map on another thread waits for a run copy.

    python -m pytest -q tests/gpu/test_run_copy_cuda.py
    OUT=/some/dir python -m pytest -q -s tests/gpu/test_run_copy_cuda.py -k map   # also writes the map timings

The last test is a measurement: it records (prints, and writes ``$OUT/run_copy_map-<page>mib.json``
when ``OUT`` is set) how long a 2 GiB map takes alone, beside a 2 GiB load by the direct kernels and
beside the same load as copy-engine runs; it asserts only that the copies are exact.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time

import pytest
import torch

from kvelastic.offload.copier import BlockCopier
from kvelastic.pool import PagePool
from tests.copier_cases import round_trip

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
MIB = 1024 * 1024
KIB = 1024
SHAPES = {"8b": (32, 32), "1b": (16, 16)}  # layers, KiB per K (or V) run of a block


def vmm_kv(pool: PagePool, layers: int, run: int, num_blocks: int) -> list[torch.Tensor]:
    """Views like vLLM's FlashAttention cache over pool pages: per layer the K runs, then the V runs."""
    raws = [pool.add_tensor(num_blocks * 2 * run) for _ in range(layers)]
    pool.map_groups(range(-(-num_blocks * 2 * run // pool.page_bytes)))
    views = [torch.as_strided(r, (num_blocks, run), (run, 1), half * num_blocks * run) for r in raws for half in (0, 1)]
    for r in raws:
        r.view(torch.bfloat16).normal_()
    return views


def rows_of(views: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.stack([torch.cat([v[i] for v in views]) for i in ids]).cpu()


def batch(layout: str, rng: random.Random, num_blocks: int, size: int, capacity: int) -> tuple[list[int], list[int]]:
    """``runs``: consecutive ids to consecutive slots; ``scattered``: neither; ``mixed``: two runs, a short one
    and scattered pairs, shuffled."""
    if layout == "runs":
        first = rng.randrange(num_blocks - size)
        return list(range(first, first + size)), list(range(7, 7 + size))
    if layout == "scattered":
        return rng.sample(range(num_blocks), size), rng.sample(range(capacity), size)
    pairs = list(zip(range(10, 50), range(0, 40))) + list(zip(range(100, 120), range(60, 80)))
    pairs += list(zip(range(130, 135), range(90, 95)))
    free_ids = rng.sample([b for b in range(140, num_blocks)], size - len(pairs))
    free_slots = rng.sample([s for s in range(100, capacity)], size - len(pairs))
    pairs += list(zip(free_ids, free_slots))
    rng.shuffle(pairs)
    return [p[0] for p in pairs], [p[1] for p in pairs]


@pytest.mark.parametrize("widths", [[4096, 4096], [1000, 24], [5, 3]], ids=["int64", "int64-odd", "int8"])
def test_round_trip_is_exact_on_the_device(widths):
    round_trip("cuda", "runs", widths)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", ["runs", "scattered", "mixed"])
def test_runs_move_the_same_bytes_as_direct_over_vmm_pages(shape, layout):
    from kvelastic.pool.cuda import CudaBackend

    layers, run_kib = SHAPES[shape]
    rng = random.Random(layers)
    num_blocks, size, capacity = 256, 96, 192
    pool = PagePool.standard(CudaBackend(), page_bytes=2 * MIB, zero_on_map="fresh")
    try:
        views = vmm_kv(pool, layers, run_kib * KIB, num_blocks)
        row = 2 * layers * run_kib * KIB
        hosts = {p: torch.zeros((capacity, row), dtype=torch.int8, pin_memory=True) for p in ("direct", "runs")}
        copiers = {p: BlockCopier(views, hosts[p], path=p) for p in hosts}  # type: ignore[arg-type]
        ids, slots = batch(layout, rng, num_blocks, size, capacity)
        want = rows_of(views, ids)
        for copier in copiers.values():
            copier.store(ids, slots).wait()
        assert torch.equal(hosts["runs"], hosts["direct"])
        assert torch.equal(hosts["runs"][slots], want)
        moved = copiers["runs"].mover.moved
        assert moved["runs"] == {"runs": size, "scattered": 0, "mixed": 60}[layout]
        targets = [(i + 1) % num_blocks for i in ids]  # runs stay runs one block further on
        copiers["runs"].load(targets, slots).wait()
        torch.cuda.synchronize()
        assert torch.equal(rows_of(views, targets), want)
        del views, copiers
    finally:
        torch.cuda.synchronize()
        pool.close()


def test_runs_over_background_pinned_tier_memory_end_at_a_chunk():
    """The tier's own buffer is registered chunk by chunk, and no copy may span two registrations: a run
    across a chunk start must go out as two transfers (or the driver refuses it)."""
    from kvelastic.offload.host_memory import CudaPinner, HostMemory, chunk_plan

    slot = 2 * MIB
    memory = HostMemory(300, slot, pinner=CudaPinner())
    try:
        assert memory.wait(120) and memory.failure is None
        boundary = chunk_plan(memory.slots, slot)[1][1]
        slots = list(range(boundary - 40, boundary + 40))
        kv = torch.randint(-128, 127, (200, slot), dtype=torch.int8, device="cuda")
        copier = BlockCopier([kv], memory.buffer, path="runs", breaks=memory.breaks)
        copier.store(list(range(80)), slots).wait()
        assert torch.equal(memory.buffer[slots], kv[:80].cpu())
        assert copier.mover.moved == {"runs": 80, "direct": 0}
        copier.load(list(range(100, 180)), slots).wait()
        torch.cuda.synchronize()
        assert torch.equal(kv[100:180], kv[:80])
        del copier
    finally:
        torch.cuda.synchronize()
        memory.free()


def test_a_run_store_returns_before_the_copy_ends_and_a_run_load_orders_compute():
    blocks = torch.randint(-128, 127, (2048, 512 * KIB), dtype=torch.int8, device="cuda")
    host = torch.zeros((2048, 512 * KIB), dtype=torch.int8, pin_memory=True)
    copier = BlockCopier([blocks], host, path="runs")
    copier.store(list(range(64)), list(range(64))).wait()  # warm-up: first-use costs
    torch.cuda.synchronize()
    fence = copier.store(list(range(2048)), list(range(2048)))
    assert not fence.is_done(), "a 1 GiB store finished before store() returned: it blocked the host"
    fence.wait()
    assert torch.equal(host[:16], blocks[:16].cpu()) and torch.equal(host[-16:], blocks[-16:].cpu())
    blocks[100:200].zero_()
    copier.load(list(range(100, 200)), list(range(300, 400)))
    total = int(blocks[100:200].to(torch.int64).sum())  # on the default stream, after the load
    assert total == int(host[300:400].to(torch.int64).sum())
    assert copier.mover.moved["direct"] == 0


class MapJob:
    """A 2 GiB map like a reload's: per layer one address range of pages, created up front, mapped timed."""

    def __init__(self, backend, layers: int, total: int, page: int):
        from kvelastic.pool.backend import MapRun

        self.backend, self.page, self.per_layer = backend, page, total // layers // page
        backend.use_page_size(page)
        self.ranges = [backend.reserve_address(self.per_layer * page) for _ in range(layers)]
        handles = [backend.create_page(page) for _ in range(layers * self.per_layer)]
        self.handles = handles
        self.runs = [MapRun(a, tuple(handles[i * self.per_layer:(i + 1) * self.per_layer]))
                     for i, a in enumerate(self.ranges)]

    def map_ms(self) -> float:
        t = time.perf_counter()
        self.backend.map_runs(self.runs, self.page, zero=False)
        return (time.perf_counter() - t) * 1e3

    def unmap(self) -> None:
        for address in self.ranges:
            self.backend.unmap(address, self.per_layer * self.page)

    def close(self) -> None:
        for handle in self.handles:
            self.backend.release_page(handle)
        for address in self.ranges:
            self.backend.free_address(address, self.per_layer * self.page)


def beside(job: MapJob, copy) -> tuple[float, float]:
    """Start ``copy`` (which queues a load and returns its fence), map on another thread meanwhile;
    (map ms, copy GPU ms)."""
    ready, took = threading.Event(), []
    thread = threading.Thread(target=lambda: (ready.wait(), took.append(job.map_ms())))
    thread.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fence = copy()
    ready.set()
    fence.wait()
    end.record()
    thread.join()
    end.synchronize()
    torch.cuda.synchronize()
    job.unmap()
    return took[0], start.elapsed_time(end)


@pytest.mark.parametrize("page_mib", [8, 2])
def test_record_how_long_a_map_waits_beside_a_run_copy_and_beside_direct(page_mib):
    from kvelastic.pool.cuda import CudaBackend

    layers, run_kib = SHAPES["8b"]
    num_blocks, reps = 1024, 3
    pool = PagePool.standard(CudaBackend(), page_bytes=8 * MIB, zero_on_map="fresh")
    backend = CudaBackend()
    job = None
    try:
        views = vmm_kv(pool, layers, run_kib * KIB, num_blocks)
        host = torch.zeros((num_blocks, 2 * layers * run_kib * KIB), dtype=torch.int8, pin_memory=True)
        copiers = {p: BlockCopier(views, host, path=p) for p in ("direct", "runs")}  # type: ignore[arg-type]
        ids = list(range(num_blocks))
        copiers["direct"].store(ids, ids).wait()
        want = host.clone()
        job = MapJob(backend, layers, num_blocks * host.shape[1], page_mib * MIB)
        rows: dict[str, list[float]] = {}
        for _ in range(reps):
            rows.setdefault("map alone", []).append(job.map_ms())
            torch.cuda.synchronize()
            job.unmap()
            for path, copier in copiers.items():
                copier.load(ids, ids).wait()  # warm
                map_ms, copy_ms = beside(job, lambda: copier.load(ids, ids))
                rows.setdefault(f"map beside {path}", []).append(map_ms)
                rows.setdefault(f"{path} load ms", []).append(copy_ms)
        copiers["runs"].store(ids, ids).wait()
        assert torch.equal(host, want), "a round trip through the runs path changed bytes"
        assert copiers["runs"].mover.moved["direct"] == 0
        result = {"device": torch.cuda.get_device_name(), "page_mib": page_mib, "total_mib": 2048, "reps": reps,
                  **{k: statistics.median(v) for k, v in rows.items()}}
        print(json.dumps(result))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"run_copy_map-{page_mib}mib.json"), "w") as f:
                json.dump(result, f, indent=1)
        del views, copiers
    finally:
        torch.cuda.synchronize()
        if job is not None:
            job.close()
        backend.close()
        pool.close()
