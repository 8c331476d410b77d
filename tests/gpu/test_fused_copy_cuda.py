"""The fused gather of the staged movers on a real GPU: byte for byte what the direct path moves, over VMM pages.

Over the tier's own memory and for the host thread never waiting, the staged movers run in the shared tests
(test_host_memory_cuda.py, test_copier_cuda.py).

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
    copier = round_trip("cuda", "direct", widths, staging_bytes=7 * sum(widths))
    assert copier._side_mover.fused is not None and copier._async_load_mover.fused is not None


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
def test_the_staged_movers_move_the_same_bytes_as_direct_over_vmm_pages(layers, run_kib, slots):
    from kvelastic.pool.cuda import CudaBackend

    rng = random.Random(layers)
    num_blocks, batch, capacity = 256, 96, 192
    pool = PagePool.standard(CudaBackend(), page_bytes=2 * MIB, zero_on_map="fresh")
    try:
        views = vmm_kv(pool, layers, run_kib * KIB, num_blocks)
        row = 2 * layers * run_kib * KIB
        hosts = {p: torch.zeros((capacity, row), dtype=torch.int8, pin_memory=True) for p in ("direct", "staged")}
        direct = BlockCopier(views, hosts["direct"], path="direct")
        staged = BlockCopier(views, hosts["staged"], path="direct", staged_side_stores=True, staged_loads=True)
        for mover in (staged._side_mover, staged._async_load_mover):
            launch = mover.fused.launch
            assert (launch.align, launch.even) == (16, True), f"the engine's layout takes 16-byte accesses: {launch}"
        ids = rng.sample(range(num_blocks), batch)
        targets = list(range(batch)) if slots == "runs" else rng.sample(range(capacity), batch)
        want = torch.stack([torch.cat([v[i] for v in views]) for i in ids]).cpu()
        direct.store(ids, targets).wait()
        staged.store_beside(ids, targets).wait()
        assert torch.equal(hosts["staged"], hosts["direct"])
        assert torch.equal(hosts["staged"][targets], want)
        destinations = rng.sample(range(num_blocks), batch)
        staged.load(destinations, targets, block_compute=False).wait()
        torch.cuda.synchronize()
        got = torch.stack([torch.cat([v[i] for v in views]) for i in destinations]).cpu()
        assert torch.equal(got, want)
        del views, direct, staged
    finally:
        torch.cuda.synchronize()
        pool.close()
