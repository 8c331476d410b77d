"""The page pool on a real GPU: driver-level memory moves by exactly what the pool maps."""

from __future__ import annotations

import gc

import pytest
import torch

from kvelastic.errors import PoolLimitExceeded
from kvelastic.pool import PagePool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
MIB = 1024 * 1024
PAGE = 2 * MIB


@pytest.fixture
def pool():
    from kvelastic.pool.cuda import CudaBackend

    torch.cuda.init()
    p = PagePool.standard(CudaBackend(), page_bytes=PAGE)
    yield p
    p.close()
    assert p.leak_report() == []


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_mem_get_info_moves_by_exactly_the_mapped_bytes(pool):
    tensors = [pool.add_tensor(256 * MIB) for _ in range(8)]
    pool.map_groups([0])  # first mapping may set up driver state; measure after it
    pool.unmap_groups([0])
    pool.trim_reserve(0)
    before = _free()
    pool.map_groups(range(64))  # 64 groups x 8 tensors x 2 MiB = 1 GiB
    after_map = _free()
    assert before - after_map == 1024 * MIB
    pool.unmap_groups(range(32))
    pool.trim_reserve(0)
    assert _free() - after_map == 512 * MIB
    pool.unmap_groups(range(64))
    pool.trim_reserve(0)
    assert _free() == before
    del tensors


def test_kernels_read_and_write_views_and_pages_map_as_zeros(pool):
    a = pool.add_tensor(64 * MIB)
    b = pool.add_tensor(64 * MIB + 123)
    pool.map_groups(range(33))
    assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0
    fa = a.view(torch.float32)
    fa.copy_(torch.arange(fa.numel(), device="cuda", dtype=torch.float32))
    b[:64 * MIB].copy_(a)
    assert torch.equal(b[:64 * MIB], a)
    assert float(fa.sum()) == pytest.approx(fa.numel() * (fa.numel() - 1) / 2, rel=1e-3)
    pool.unmap_groups(range(16, 33))
    pool.map_groups(range(16, 33))  # pages come back from the reserve, still holding old data
    assert torch.count_nonzero(a[16 * PAGE:]) == 0 and torch.count_nonzero(b[16 * PAGE:]) == 0
    assert torch.equal(fa[: 16 * PAGE // 4], torch.arange(16 * PAGE // 4, device="cuda", dtype=torch.float32))


def test_limit_and_fenced_unmap_on_device(pool):
    t = pool.add_tensor(128 * MIB)
    pool.set_limit(32 * MIB)
    pool.map_groups(range(16))
    with pytest.raises(PoolLimitExceeded):
        pool.map_groups([16])
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big  # keep the GPU busy so the fence is still pending
        big = big / big.norm()
    t[:PAGE].fill_(3)
    fence = pool.backend.record_fence()
    pool.unmap_groups([0], fence=fence)
    pending = pool.stats().pending_unmap_bytes
    fence.wait()
    pool.collect()
    assert pool.stats().pending_unmap_bytes == 0
    assert pending in (0, PAGE)


def test_dropping_a_tensor_frees_device_memory(pool):
    keep = pool.add_tensor(64 * MIB)
    drop = pool.add_tensor(64 * MIB)
    pool.map_groups(range(32))
    before = _free()
    del drop
    gc.collect()
    pool.map_groups([0])  # any pool call retires dead regions
    pool.trim_reserve(0)
    assert _free() - before == 64 * MIB
    keep.fill_(1)
    torch.cuda.synchronize()


def test_parked_groups_are_adopted_without_driver_calls_and_read_as_zero(pool, monkeypatch):
    tensors = [pool.add_tensor(64 * MIB) for _ in range(4)]
    pool.map_groups([0])
    tensors[0][:PAGE].fill_(3)
    pool.grow_reserve(8)  # two whole groups of four pages, parked at groups 1 and 2
    assert pool.parked_groups() == {1, 2}
    for t in tensors:
        assert int(torch.count_nonzero(t[PAGE:3 * PAGE])) == 0  # parked pages are mapped, and zeroed
    torch.cuda.synchronize()
    before = _free()
    calls = []
    original = pool.backend.map_runs
    monkeypatch.setattr(pool.backend, "map_runs", lambda *a, **k: (calls.append(a), original(*a, **k)))
    assert pool.map_groups([1, 2]) == 2
    assert calls == [] and _free() == before  # no mapping, no new memory: the pages were already there
    for t in tensors:
        t[PAGE:3 * PAGE].fill_(5)
        assert int(t[PAGE:3 * PAGE].sum()) == 5 * 2 * PAGE
    assert int(tensors[0][:PAGE].sum()) == 3 * PAGE
    pool.unmap_groups([0, 1, 2])
    pool.trim_reserve(0)
    assert pool.stats().held_bytes == 0


def test_pages_given_back_right_after_their_zero_fill_was_queued_behind_busy_kernels(pool):
    """The fill runs only after the kernel ahead of it; unmapping before then killed the context
    (CUDA_ERROR_ILLEGAL_ADDRESS, an H200, 2026-11-28): the pool now waits for the fill first."""
    tensors = [pool.add_tensor(64 * MIB) for _ in range(4)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of one SM spinning, ahead of the fills below
    pool.grow_reserve(8)
    pool.trim_reserve(0)
    torch.cuda._sleep(200_000_000)
    pool.map_groups([3])
    pool.unmap_groups([3])  # no fence: the caller has no kernel on it, but the fill is ours
    torch.cuda.synchronize()  # raises if a fill met an unmapped page
    pool.trim_reserve(0)  # group 3's pages went back to the reserve
    assert pool.stats().held_bytes == 0
    pool.map_groups([0])
    assert int(torch.count_nonzero(tensors[0][:PAGE])) == 0
