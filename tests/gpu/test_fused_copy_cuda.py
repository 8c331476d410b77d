"""The fused copy path on a real GPU: byte for byte what the direct path moves, over VMM pages and tier memory.

    python -m pytest -q tests/gpu/test_fused_copy_cuda.py
"""

from __future__ import annotations

import random

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


@pytest.fixture(autouse=True)
def compiled_not_interpreted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("widths", [[4096, 4096], [1000, 24], [5, 3]], ids=["int64", "int64-odd", "int8"])
def test_round_trip_is_exact_on_the_device(widths):
    round_trip("cuda", "fused", widths, staging_bytes=0)


def vmm_kv(pool: PagePool, layers: int, run: int, num_blocks: int) -> list[torch.Tensor]:
    """Views like vLLM's FlashAttention cache over pool pages: per layer the K runs, then the V runs."""
    raws = [pool.add_tensor(num_blocks * 2 * run) for _ in range(layers)]
    pool.map_groups(range(-(-num_blocks * 2 * run // pool.page_bytes)))
    views = [torch.as_strided(r, (num_blocks, run), (run, 1), half * num_blocks * run) for r in raws for half in (0, 1)]
    for r in raws:
        r.view(torch.bfloat16).normal_()
    return views


@pytest.mark.parametrize("layers, run_kib", [(32, 32), (16, 16)], ids=["8b", "1b"])
@pytest.mark.parametrize("slots", ["runs", "scattered"])
def test_fused_moves_the_same_bytes_as_direct_over_vmm_pages(layers, run_kib, slots):
    from kvelastic.pool.cuda import CudaBackend

    rng = random.Random(layers)
    num_blocks, batch, capacity = 256, 96, 192
    pool = PagePool.standard(CudaBackend(), page_bytes=2 * MIB, zero_on_map="fresh")
    try:
        views = vmm_kv(pool, layers, run_kib * KIB, num_blocks)
        row = 2 * layers * run_kib * KIB
        hosts = {p: torch.zeros((capacity, row), dtype=torch.int8, pin_memory=True) for p in ("direct", "fused")}
        copiers = {p: BlockCopier(views, hosts[p], path=p) for p in hosts}  # type: ignore[arg-type]
        launch = copiers["fused"].mover.launch
        assert (launch.align, launch.even) == (16, True), f"the engine's layout must take 16-byte accesses: {launch}"
        ids = rng.sample(range(num_blocks), batch)
        targets = list(range(batch)) if slots == "runs" else rng.sample(range(capacity), batch)
        want = torch.stack([torch.cat([v[i] for v in views]) for i in ids]).cpu()
        for copier in copiers.values():
            copier.store(ids, targets).wait()
        assert torch.equal(hosts["fused"], hosts["direct"])
        assert torch.equal(hosts["fused"][targets], want)
        destinations = rng.sample(range(num_blocks), batch)
        copiers["fused"].load(destinations, targets).wait()
        torch.cuda.synchronize()
        got = torch.stack([torch.cat([v[i] for v in views]) for i in destinations]).cpu()
        assert torch.equal(got, want)
        del views, copiers
    finally:
        torch.cuda.synchronize()
        pool.close()


def test_fused_over_background_pinned_tier_memory_across_a_chunk():
    """The tier's own buffer (one mmap registered chunk by chunk): slots on both sides of a registration."""
    from kvelastic.offload.host_memory import CudaPinner, HostMemory, chunk_plan

    slot = 2 * MIB
    memory = HostMemory(160, slot, pinner=CudaPinner())
    try:
        assert memory.wait(120) and memory.failure is None
        boundary = chunk_plan(memory.slots, slot)[1][1]
        slots = list(range(boundary - 4, boundary + 4))
        kv = torch.randint(-128, 127, (32, slot), dtype=torch.int8, device="cuda")
        copier = BlockCopier([kv], memory.buffer, path="fused", breaks=memory.breaks)
        copier.store(list(range(8)), slots).wait()
        assert torch.equal(memory.buffer[slots], kv[:8].cpu())
        copier.load(list(range(24, 32)), slots).wait()
        torch.cuda.synchronize()
        assert torch.equal(kv[24:], kv[:8])
        del copier
    finally:
        torch.cuda.synchronize()
        memory.free()


def test_a_fused_store_returns_before_the_copy_ends_and_a_load_orders_compute():
    blocks = torch.randint(-128, 127, (2048, 512 * KIB), dtype=torch.int8, device="cuda")
    host = torch.zeros((2048, 512 * KIB), dtype=torch.int8, pin_memory=True)
    copier = BlockCopier([blocks], host, path="fused")
    torch.cuda.synchronize()
    fence = copier.store(list(range(2048)), list(range(2048)))
    assert not fence.is_done(), "a 1 GiB store finished before store() returned: it blocked the host"
    fence.wait()
    assert torch.equal(host[:16], blocks[:16].cpu()) and torch.equal(host[-16:], blocks[-16:].cpu())
    blocks.zero_()
    copier.load([5], [9])
    total = int(blocks[5].to(torch.int64).sum())  # on the default stream, after the load
    assert total == int(host[9].to(torch.int64).sum())
    times = copier.copy_times()
    assert times is not None and times["store_timed_bytes"] == 2048 * 512 * KIB
