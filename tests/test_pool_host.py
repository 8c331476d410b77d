"""The page pool over the host backend: real mappings, real resident memory."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from kvelastic.errors import DeviceOutOfMemory, PoolClosedError, PoolError, PoolLimitExceeded
from kvelastic.pool import Fence, HostBackend, PagePool
from tests.conftest import SMALL_PAGE

MIB = 1024 * 1024


def _rss_shmem_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem line in /proc/self/status")


class ManualFence(Fence):
    """Stands in for a CUDA event: the test decides when the device is done."""

    def __init__(self) -> None:
        self.done = False

    def is_done(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.done = True


def test_tensor_has_exact_size_and_reads_zero_when_mapped(host_pool):
    t = host_pool.add_tensor(3 * SMALL_PAGE + 100)
    assert t.numel() == 3 * SMALL_PAGE + 100 and t.dtype == torch.int8
    host_pool.map_groups(range(4))
    assert torch.count_nonzero(t) == 0


def test_data_survives_mapping_and_unmapping_of_other_groups(host_pool):
    tensors = [host_pool.add_tensor(8 * SMALL_PAGE) for _ in range(3)]
    host_pool.map_groups([2, 5])
    for i, t in enumerate(tensors):
        t[2 * SMALL_PAGE:3 * SMALL_PAGE] = i + 1
        t[5 * SMALL_PAGE:6 * SMALL_PAGE] = -(i + 1)
    host_pool.map_groups([0, 1, 7])
    host_pool.unmap_groups([0, 7])
    host_pool.map_groups([3, 4])
    host_pool.unmap_groups([1, 3])
    for i, t in enumerate(tensors):
        assert torch.all(t[2 * SMALL_PAGE:3 * SMALL_PAGE] == i + 1)
        assert torch.all(t[5 * SMALL_PAGE:6 * SMALL_PAGE] == -(i + 1))


def test_group_touches_every_tensor(host_pool):
    a = host_pool.add_tensor(4 * SMALL_PAGE)
    b = host_pool.add_tensor(2 * SMALL_PAGE)
    host_pool.map_groups([1])
    a[SMALL_PAGE:2 * SMALL_PAGE] = 1
    b[SMALL_PAGE:2 * SMALL_PAGE] = 1
    stats = host_pool.stats()
    assert stats.mapped_bytes == 2 * SMALL_PAGE and stats.groups_mapped == 1
    host_pool.map_groups([3])  # b is too short to have a page 3
    assert host_pool.stats().mapped_bytes == 3 * SMALL_PAGE


def test_resident_memory_follows_mapped_bytes():
    pool = PagePool.standard(HostBackend(), page_bytes=2 * MIB)
    try:
        tensors = [pool.add_tensor(64 * MIB) for _ in range(4)]
        base = _rss_shmem_bytes()
        pool.map_groups(range(16))  # 16 groups x 4 tensors x 2 MiB = 128 MiB, zeroed on map
        grown = _rss_shmem_bytes() - base
        assert pool.stats().mapped_bytes == 128 * MIB
        assert 120 * MIB <= grown <= 136 * MIB
        pool.unmap_groups(range(16))
        assert _rss_shmem_bytes() - base < 8 * MIB
        del tensors
    finally:
        pool.close()
    assert pool.leak_report() == []


def test_limit_is_enforced_all_or_nothing(host_pool):
    tensors = [host_pool.add_tensor(16 * SMALL_PAGE) for _ in range(2)]
    host_pool.set_limit(5 * SMALL_PAGE)
    host_pool.map_groups([0, 1])
    with pytest.raises(PoolLimitExceeded) as info:
        host_pool.map_groups([2, 3])
    assert info.value.requested_bytes == 4 * SMALL_PAGE
    assert info.value.available_bytes == SMALL_PAGE
    assert host_pool.mapped_groups() == {0, 1}
    assert host_pool.stats().mapped_bytes == 4 * SMALL_PAGE
    assert len(tensors) == 2


def test_device_out_of_memory_is_typed_and_leaves_state_alone():
    pool = PagePool.standard(HostBackend(max_bytes=3 * SMALL_PAGE), page_bytes=SMALL_PAGE)
    try:
        tensor = pool.add_tensor(8 * SMALL_PAGE)
        pool.map_groups([0, 1])
        with pytest.raises(DeviceOutOfMemory):
            pool.map_groups([2, 3])
        assert pool.mapped_groups() == {0, 1}
        assert pool.backend.device_free_bytes() == SMALL_PAGE
        assert torch.count_nonzero(tensor[:2 * SMALL_PAGE]) == 0
    finally:
        pool.close()
    assert pool.leak_report() == []


def test_lowering_the_limit_trims_the_reserve_and_reports_excess(host_pool):
    tensor = host_pool.add_tensor(16 * SMALL_PAGE)
    host_pool.map_groups(range(4))
    assert host_pool.grow_reserve(4) == 4
    assert host_pool.stats().held_bytes == 8 * SMALL_PAGE
    over = host_pool.set_limit(6 * SMALL_PAGE)
    stats = host_pool.stats()
    assert stats.reserve_bytes == 2 * SMALL_PAGE and over == 0
    over = host_pool.set_limit(3 * SMALL_PAGE)
    assert host_pool.stats().reserve_bytes == 0 and over == SMALL_PAGE
    host_pool.unmap_groups([3])
    assert host_pool.stats().over_limit_bytes == 0
    assert tensor.numel() == 16 * SMALL_PAGE


def test_reserve_serves_maps_without_creating(host_pool):
    tensor = host_pool.add_tensor(16 * SMALL_PAGE)
    host_pool.grow_reserve(4)
    created = host_pool.stats().pages_created
    host_pool.map_groups(range(4))
    stats = host_pool.stats()
    assert stats.pages_created == created and stats.reserve_hits == 4
    host_pool.unmap_groups(range(4))
    assert host_pool.stats().reserve_bytes == 4 * SMALL_PAGE
    assert host_pool.trim_reserve(1) == 3
    assert tensor.numel() == 16 * SMALL_PAGE


def test_fenced_unmap_waits_for_the_fence(host_pool):
    t = host_pool.add_tensor(4 * SMALL_PAGE)
    host_pool.map_groups([0, 1])
    t[:SMALL_PAGE] = 9
    fence = ManualFence()
    host_pool.unmap_groups([0], fence=fence)
    stats = host_pool.stats()
    assert not host_pool.is_mapped(0)
    assert stats.pending_unmap_bytes == SMALL_PAGE and stats.mapped_bytes == SMALL_PAGE
    assert torch.all(t[:SMALL_PAGE] == 9)  # still readable: the "GPU" may still use it
    assert host_pool.collect() == 0
    fence.done = True
    assert host_pool.collect() == 1
    assert host_pool.stats().pending_unmap_bytes == 0


def test_remapping_a_pending_group_revives_its_pages(host_pool):
    t = host_pool.add_tensor(2 * SMALL_PAGE)
    host_pool.map_groups([0])
    t[:10] = 5
    fence = ManualFence()
    host_pool.unmap_groups([0], fence=fence)
    host_pool.map_groups([0])
    fence.done = True
    host_pool.collect()
    assert host_pool.is_mapped(0)
    assert torch.all(t[:10] == 5)  # never unmapped, so never re-zeroed
    assert host_pool.stats().mapped_bytes == SMALL_PAGE


def test_dropping_the_tensor_frees_its_region_and_pages(host_pool):
    keep = host_pool.add_tensor(4 * SMALL_PAGE)
    drop = host_pool.add_tensor(4 * SMALL_PAGE)
    host_pool.map_groups([0, 1])
    assert host_pool.stats().mapped_bytes == 4 * SMALL_PAGE
    view = drop[SMALL_PAGE:]
    del drop
    gc.collect()
    assert len(host_pool.regions) == 2  # a view still holds the region
    del view
    gc.collect()
    host_pool.map_groups([2])
    assert len(host_pool.regions) == 1
    assert host_pool.stats().mapped_bytes == 3 * SMALL_PAGE
    keep[:4] = 1


def test_region_of_finds_views(host_pool):
    first = host_pool.add_tensor(2 * SMALL_PAGE)
    t = host_pool.add_tensor(2 * SMALL_PAGE)
    assert host_pool.region_of(first).region_id != host_pool.region_of(t).region_id
    assert host_pool.region_of(t[100:]).nbytes == 2 * SMALL_PAGE
    with pytest.raises(PoolError):
        host_pool.region_of(torch.zeros(4))


def test_bad_arguments_are_rejected():
    with pytest.raises(PoolError):
        PagePool.standard(HostBackend(), page_bytes=1000)
    pool = PagePool.standard(HostBackend(), page_bytes=SMALL_PAGE)
    with pytest.raises(PoolError):
        pool.add_tensor(0)
    pool.close()


def test_use_after_close_raises_and_close_frees_everything():
    pool = PagePool.standard(HostBackend(), page_bytes=SMALL_PAGE)
    tensor = pool.add_tensor(8 * SMALL_PAGE)
    pool.map_groups(range(5))
    pool.grow_reserve(3)
    pool.unmap_groups([4], fence=ManualFence())
    pool.close()
    assert pool.leak_report() == []
    with pytest.raises(PoolClosedError):
        pool.map_groups([0])
    del tensor


def test_concurrent_map_and_unmap_from_threads(host_pool):
    tensors = [host_pool.add_tensor(64 * SMALL_PAGE) for _ in range(4)]
    errors: list[BaseException] = []

    def worker(lane: int) -> None:
        try:
            groups = list(range(lane * 16, lane * 16 + 16))
            for round_ in range(30):
                host_pool.map_groups(groups)
                for t in tensors:
                    for g in groups:
                        t[g * SMALL_PAGE] = lane + round_ % 7
                for t in tensors:
                    for g in groups:
                        assert t[g * SMALL_PAGE] == lane + round_ % 7
                host_pool.unmap_groups(groups[round_ % 2::2])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(lane,)) for lane in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = host_pool.stats()
    assert stats.mapped_bytes == stats.groups_mapped * 4 * SMALL_PAGE
    assert stats.held_bytes == stats.mapped_bytes + stats.reserve_bytes


def test_fresh_zero_policy_zeroes_new_pages_only():
    pool = PagePool.standard(HostBackend(), page_bytes=SMALL_PAGE, zero_on_map="fresh")
    try:
        t = pool.add_tensor(4 * SMALL_PAGE)
        pool.map_groups([0, 1])
        assert torch.count_nonzero(t[:2 * SMALL_PAGE]) == 0
        t[:2 * SMALL_PAGE] = 7
        pool.unmap_groups([0, 1])
        pool.map_groups([2, 3])  # recycled pages keep the pool's own old data
        assert torch.all(t[2 * SMALL_PAGE:] == 7)
        pool.unmap_groups([2, 3])
        pool.trim_reserve(0)  # pages given back: a new page with a reused handle is fresh again
        pool.map_groups([0])
        assert torch.count_nonzero(t[:SMALL_PAGE]) == 0
    finally:
        pool.close()
    with pytest.raises(PoolError):
        PagePool.standard(HostBackend(), page_bytes=SMALL_PAGE, zero_on_map="sometimes")


def test_view_of_keeps_the_region_alive(host_pool):
    t = host_pool.add_tensor(2 * SMALL_PAGE)
    host_pool.map_groups([0])
    region = host_pool.region_of(t)
    extra = host_pool.view_of(region)
    del t
    gc.collect()
    host_pool.map_groups([1])  # would retire the region if nothing held it
    assert host_pool.regions_alive() == 1
    extra[:4] = 3
    assert int(extra[3]) == 3
    del extra
    gc.collect()
    assert host_pool.regions_alive() == 0
    with pytest.raises(PoolError):
        host_pool.view_of(region)
