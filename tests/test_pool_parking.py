"""Parked warm pages: mapped ahead at the groups asked for next, adopted without a driver call.

Real host mappings (the host backend maps shared-memory pages with mmap), so the
process's resident memory shows what is really held.
"""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from kvelastic.errors import PoolLimitExceeded
from kvelastic.pool import GroupLayout, HostBackend, PagePool, PageRef
from tests.conftest import SMALL_PAGE
from tests.test_pool_host import ManualFence, _rss_shmem_bytes


class CountingHostBackend(HostBackend):
    """The host backend, counting the pages it is asked to map (the driver calls on CUDA)."""

    def __init__(self, max_bytes: int | None = None):
        super().__init__(max_bytes)
        self.pages_mapped = 0
        self.map_calls = 0

    def map_runs(self, runs, page_bytes, *, zero):
        self.map_calls += 1
        self.pages_mapped += sum(len(run.handles) for run in runs)
        super().map_runs(runs, page_bytes, zero=zero)


@pytest.fixture
def pool():
    pool = PagePool.standard(CountingHostBackend(), page_bytes=SMALL_PAGE)
    yield pool
    pool.close()
    assert pool.leak_report() == []


def test_growing_the_reserve_parks_it_at_the_lowest_unmapped_groups(pool):
    tensors = [pool.add_tensor(8 * SMALL_PAGE) for _ in range(3)]
    pool.map_groups([0, 2])
    assert pool.grow_reserve(6) == 6
    assert pool.parked_groups() == {1, 3}
    s = pool.stats()
    assert (s.mapped_bytes, s.reserve_bytes, s.held_bytes) == (6 * SMALL_PAGE, 6 * SMALL_PAGE, 12 * SMALL_PAGE)
    assert not pool.is_mapped(1) and pool.mapped_groups() == {0, 2}
    before = pool.backend.map_calls
    assert pool.map_groups([1, 3]) == 2
    assert pool.backend.map_calls == before, "adopting parked groups must not call the backend"
    assert pool.parked_groups() == frozenset()
    for t in tensors:
        assert torch.count_nonzero(t[SMALL_PAGE:2 * SMALL_PAGE]) == 0
        t[3 * SMALL_PAGE:4 * SMALL_PAGE] = 7
        assert torch.all(t[3 * SMALL_PAGE:4 * SMALL_PAGE] == 7)
    assert pool.stats().mapped_bytes == 12 * SMALL_PAGE


def test_recycled_pages_are_parked_by_grow_reserve_zero(pool):
    _alive = pool.add_tensor(4 * SMALL_PAGE)
    pool.map_groups([0, 1])
    pool.unmap_groups([0, 1])
    assert pool.parked_groups() == frozenset() and pool.stats().reserve_bytes == 2 * SMALL_PAGE
    assert pool.grow_reserve(0) == 0
    assert pool.parked_groups() == {0, 1}


def test_a_map_elsewhere_takes_parked_pages_back_when_the_limit_is_reached(pool):
    tensor = pool.add_tensor(8 * SMALL_PAGE)
    pool.set_limit(3 * SMALL_PAGE)
    pool.map_groups([0])
    tensor[:SMALL_PAGE] = 5
    pool.grow_reserve(2)
    assert pool.parked_groups() == {1, 2}
    assert pool.map_groups([6]) == 1  # no room left: the highest parked group goes back
    assert pool.parked_groups() == {1} and pool.mapped_groups() == {0, 6}
    assert pool.stats().held_bytes == 3 * SMALL_PAGE
    assert torch.all(tensor[:SMALL_PAGE] == 5)
    with pytest.raises(PoolLimitExceeded):
        pool.map_groups([4, 5])  # two pages wanted, one parked page to give: all or nothing
    assert pool.mapped_groups() == {0, 6} and pool.stats().held_bytes == 3 * SMALL_PAGE


def test_lowering_the_limit_and_trimming_unmap_parked_pages_for_real():
    pool = PagePool.standard(HostBackend(), page_bytes=1024 * 1024)
    try:
        _alive = pool.add_tensor(32 * 1024 * 1024)
        pool.map_groups([0])
        base = _rss_shmem_bytes()
        pool.grow_reserve(8)
        assert len(pool.parked_groups()) == 8
        pool.set_limit(5 * 1024 * 1024)
        assert len(pool.parked_groups()) == 4 and pool.stats().held_bytes == 5 * 1024 * 1024
        pool.trim_reserve(0)
        s = pool.stats()
        assert pool.parked_groups() == frozenset() and s.reserve_bytes == 0 and s.held_bytes == 1024 * 1024
        assert _rss_shmem_bytes() <= base + 512 * 1024
    finally:
        pool.close()


def test_headroom_counts_parked_pages(pool):
    _alive = pool.add_tensor(8 * SMALL_PAGE)
    pool.set_limit(4 * SMALL_PAGE)
    pool.grow_reserve(3)
    assert len(pool.parked_groups()) == 3
    assert pool.headroom_estimate(None) == 4 * SMALL_PAGE


def test_pages_waiting_on_a_fence_are_not_parked_over(pool):
    tensor = pool.add_tensor(4 * SMALL_PAGE)
    pool.map_groups([0, 1])
    tensor[:2 * SMALL_PAGE] = 3
    fence = ManualFence()
    pool.unmap_groups([0], fence=fence)
    pool.grow_reserve(1)
    assert pool.parked_groups() == {2}
    assert pool.map_groups([0]) == 1  # revives its own pending page, keeping its data
    assert torch.all(tensor[:SMALL_PAGE] == 3)


class SharedPageLayout(GroupLayout):
    """Group g needs pages g and g + 1 of region 0, so neighbours share a page."""

    def __init__(self, groups: int):
        self._groups = groups

    @property
    def num_groups(self) -> int:
        return self._groups

    def pages(self, group: int) -> Sequence[PageRef]:
        return [PageRef(0, group), PageRef(0, group + 1)]


def test_adopting_a_shared_page_returns_the_parked_groups_other_page(pool):
    tensor = pool.add_tensor(6 * SMALL_PAGE)
    pool.set_layout(SharedPageLayout(5))
    pool.map_groups([0])  # pages 0, 1
    pool.grow_reserve(2)
    assert pool.parked_groups() == {2}  # group 1 would need page 1, which group 0 holds
    pool.unmap_groups([0])
    pool.grow_reserve(0)  # pages 0 and 1 back in the reserve: group 0 parks
    assert pool.parked_groups() == {0, 2}
    before = pool.backend.pages_mapped
    pool.map_groups([1])  # pages 1 (parked with group 0) and 2 (parked with group 2)
    assert pool.backend.pages_mapped == before
    s = pool.stats()
    assert pool.parked_groups() == frozenset() and s.mapped_bytes == 2 * SMALL_PAGE
    assert s.reserve_bytes == 2 * SMALL_PAGE  # pages 0 and 3, unmapped again
    assert s.held_bytes == 4 * SMALL_PAGE
    tensor[SMALL_PAGE:3 * SMALL_PAGE] = 9
    assert torch.all(tensor[SMALL_PAGE:3 * SMALL_PAGE] == 9)


def test_a_map_that_needs_a_parked_groups_shared_page_and_a_fresh_one_succeeds_at_the_limit():
    """Shared pages, held at the limit: group 1 needs page 1 (parked with group 0) and page 2, which no
    warm page can back until group 0's other page goes back. The map must not be refused (a scheduling
    miss for memory the pool has: thousands of them a run in a layout whose groups share pages)."""
    pool = PagePool.standard(CountingHostBackend(), page_bytes=SMALL_PAGE, limit_bytes=2 * SMALL_PAGE)
    try:
        tensor = pool.add_tensor(6 * SMALL_PAGE)
        pool.set_layout(SharedPageLayout(5))
        pool.grow_reserve(2)
        assert pool.parked_groups() == {0} and pool.stats().held_bytes == 2 * SMALL_PAGE
        assert pool.map_groups([1]) == 1  # page 1 adopted, page 0 unmapped and reused as page 2
        s = pool.stats()
        assert pool.parked_groups() == frozenset() and s.mapped_bytes == 2 * SMALL_PAGE
        assert s.held_bytes == 2 * SMALL_PAGE and s.reserve_bytes == 0
        tensor[SMALL_PAGE:3 * SMALL_PAGE] = 5
        assert torch.all(tensor[SMALL_PAGE:3 * SMALL_PAGE] == 5)
        with pytest.raises(PoolLimitExceeded):  # a refusal that stands changes nothing
            pool.map_groups([3])
        assert pool.mapped_groups() == {1} and pool.stats().held_bytes == 2 * SMALL_PAGE
    finally:
        pool.close()
    assert pool.leak_report() == []


def test_a_refused_map_after_adopting_parked_pages_gives_them_back():
    pool = PagePool.standard(CountingHostBackend(), page_bytes=SMALL_PAGE, limit_bytes=4 * SMALL_PAGE)
    try:
        tensor = pool.add_tensor(8 * SMALL_PAGE)
        pool.set_layout(SharedPageLayout(7))
        pool.map_groups([4])  # pages 4 and 5
        pool.grow_reserve(2)
        assert pool.parked_groups() == {0}  # pages 0 and 1
        with pytest.raises(PoolLimitExceeded):  # groups 1 and 3 want pages 1 (parked), 2 and 3: one too many
            pool.map_groups([1, 3])
        s = pool.stats()
        assert pool.mapped_groups() == {4} and s.mapped_bytes == 2 * SMALL_PAGE
        assert s.held_bytes <= 4 * SMALL_PAGE and s.held_bytes == s.mapped_bytes + s.reserve_bytes
        assert pool.map_groups([1]) == 1  # what fits still maps
        tensor[SMALL_PAGE:3 * SMALL_PAGE] = 7
        assert torch.all(tensor[SMALL_PAGE:3 * SMALL_PAGE] == 7)
    finally:
        pool.close()
    assert pool.leak_report() == []


class RunCountingHostBackend(CountingHostBackend):
    """Also counts the runs: on CUDA each is one access call and one zero-fill."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def map_runs(self, runs, page_bytes, *, zero):
        self.runs += len(runs)
        super().map_runs(runs, page_bytes, zero=zero)


@pytest.mark.parametrize("batch_groups, runs", [(4, 3), (1, 12)])
def test_parking_in_turns_maps_neighbouring_small_groups_as_one_run(monkeypatch, batch_groups, runs):
    """Parking steps aside between batches of groups; within a batch each tensor's pages of neighbouring
    groups map as one run, so small groups (the 1B shape's) do not cost an access call each."""
    import kvelastic.pool.warm_pages as warm_pages

    monkeypatch.setattr(warm_pages, "PARK_BATCH_BYTES", batch_groups * 3 * SMALL_PAGE)  # 3 tensors: 3 pages a group
    backend = RunCountingHostBackend()
    pool = PagePool.standard(backend, page_bytes=SMALL_PAGE)
    try:
        tensors = [pool.add_tensor(8 * SMALL_PAGE) for _ in range(3)]  # kept: a dropped tensor's region goes
        assert pool.grow_reserve(12) == 12  # four groups of three pages
        assert pool.parked_groups() == {0, 1, 2, 3}
        assert backend.runs == runs  # one batch: a run of 4 pages per tensor; a group a batch: 12 runs of 1
        assert all(torch.count_nonzero(t[:4 * SMALL_PAGE]) == 0 for t in tensors)  # mapped, and zeroed
    finally:
        pool.close()


def test_batches_of_groups_hold_about_the_pages_asked_and_at_least_one_group():
    from kvelastic.pool.warm_pages import _batches

    groups = [(g, [PageRef(0, g), PageRef(1, g)]) for g in range(5)]  # two pages each
    assert [[g for g, _ in b] for b in _batches(groups, 4)] == [[0, 1], [2, 3], [4]]
    assert [[g for g, _ in b] for b in _batches(groups, 1)] == [[0], [1], [2], [3], [4]]  # a group over the size
    assert _batches([], 4) == []
