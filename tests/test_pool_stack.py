"""Page source stacks the caller builds: each layer answers for itself and asks only its upstream."""

from __future__ import annotations

import os

import pytest
import torch

from kvelastic.errors import PoolError, PoolLimitExceeded
from kvelastic.pool import (
    DeviceSource,
    HostBackend,
    LimitedSource,
    MapRun,
    PagePool,
    PageRef,
    PageSource,
    ReserveSource,
    StatisticsSource,
)
from kvelastic.pool.host import HostPage
from tests.conftest import SMALL_PAGE as PAGE


def test_a_stack_without_a_limit_refuses_a_limit_by_name_and_answers_the_rest():
    backend = HostBackend(max_bytes=8 * PAGE)
    pool = PagePool(backend, ReserveSource(DeviceSource(backend, PAGE)))
    try:
        tensor = pool.add_tensor(8 * PAGE)
        pool.map_groups([0, 1])
        with pytest.raises(PoolError, match="no limit to set.*DeviceSource"):
            pool.set_limit(PAGE)
        stats = pool.stats()
        assert stats.limit_bytes is None and stats.held_bytes == 2 * PAGE
        assert stats.pages_created == 0  # nothing in this stack counts them
        assert pool.headroom_estimate(backend.device_free_bytes()) == 6 * PAGE
        assert pool.headroom_estimate(None) is None  # nothing bounds it that the pool knows of
        assert int(tensor[PAGE]) == 0
    finally:
        pool.close()
    assert pool.leak_report() == []


def test_the_reserve_gives_back_warm_pages_over_a_cap_deep_in_the_stack():
    """Two limits: the inner, lower one decides, though the reserve sees only the outer one."""
    backend = HostBackend()
    device = DeviceSource(backend, PAGE)
    inner = LimitedSource(device, 6 * PAGE)
    pool = PagePool(backend, ReserveSource(LimitedSource(inner, 100 * PAGE)))
    try:
        tensor = pool.add_tensor(8 * PAGE)
        pool.map_groups(range(4))
        assert pool.grow_reserve(10) == 2  # stops quietly at the inner limit
        assert pool.headroom_estimate(None) == 2 * PAGE
        inner.set_limit(5 * PAGE)  # the caller holds the layers it built
        pool.unmap_groups([3])  # a release: warm pages beyond the inner cap go back
        assert pool.stats().reserve_bytes == 2 * PAGE and device.outstanding_bytes == 5 * PAGE
        with pytest.raises(PoolLimitExceeded):
            pool.map_groups(range(3, 7))  # two from the reserve, two more the inner limit refuses
        assert pool.mapped_groups() == {0, 1, 2}
        assert int(tensor[2 * PAGE]) == 0
    finally:
        pool.close()
    assert pool.leak_report() == []


def test_statistics_count_what_passes_where_they_are_inserted():
    backend = HostBackend()
    device = DeviceSource(backend, PAGE)
    created = StatisticsSource(device)
    pool = PagePool(backend, ReserveSource(LimitedSource(created, 4 * PAGE)))
    try:
        tensor = pool.add_tensor(8 * PAGE)
        pool.map_groups(range(3))
        pool.unmap_groups([2])
        pool.map_groups([5])  # served from the reserve: nothing new is created
        pool.trim_reserve(0)
        stats = pool.stats()
        assert stats.pages_created == created.acquired_pages == 3
        assert (stats.reserve_hits, stats.reserve_misses) == (1, 3)
        assert created.outstanding_bytes == device.outstanding_bytes == 3 * PAGE
        pool.unmap_groups(range(6))
        pool.trim_reserve(0)
        assert created.released_pages == 3 and created.outstanding_bytes == 0
        assert tensor.numel() == 8 * PAGE
    finally:
        pool.close()
    assert pool.leak_report() == []


class FdHandleBackend(HostBackend):
    """The host backend as CUDA behaves: int handles that come back once freed, new pages not zeroed."""

    def __init__(self) -> None:
        super().__init__()
        self._pages: dict[int, HostPage] = {}

    def create_page(self, nbytes: int) -> int:  # type: ignore[override]
        page = super().create_page(nbytes)
        os.pwrite(page.fd, b"\x55" * nbytes, 0)  # whatever the memory held before
        self._pages[page.fd] = page
        return page.fd

    def release_page(self, handle: int) -> None:  # type: ignore[override]
        super().release_page(self._pages.pop(handle))

    def map_runs(self, runs, page_bytes, *, zero):
        pages = [MapRun(run.address, tuple(self._pages[h] for h in run.handles)) for run in runs]
        super().map_runs(pages, page_bytes, zero=zero)


class SilentDevice(DeviceSource):
    """A root that does not say when pages die."""

    watch_destroyed = PageSource.watch_destroyed


def test_fresh_zeroing_hears_of_destroyed_pages_through_every_layer():
    """The device tells the pool when pages die, however many layers lie between."""
    backend = FdHandleBackend()
    stack = ReserveSource(LimitedSource(StatisticsSource(LimitedSource(DeviceSource(backend, PAGE)))))
    pool = PagePool(backend, stack, zero_on_map="fresh")
    try:
        t = pool.add_tensor(2 * PAGE)
        pool.map_groups([0])
        first = pool._handles[PageRef(0, 0)]
        t[:PAGE] = 7
        pool.unmap_groups([0])
        pool.map_groups([1])  # the same page, recycled: keeps the pool's own data
        assert torch.all(t[PAGE:] == 7)
        pool.unmap_groups([1])
        pool.trim_reserve(0)
        pool.map_groups([0])
        assert pool._handles[PageRef(0, 0)] == first  # a new page under the old handle...
        assert torch.count_nonzero(t[:PAGE]) == 0  # ...reads as zero
    finally:
        pool.close()
    assert pool.leak_report() == []


def test_fresh_zeroing_refuses_a_root_that_cannot_report_destroyed_pages():
    backend = HostBackend()
    with pytest.raises(PoolError, match="SilentDevice does not report destroyed pages"):
        PagePool(backend, ReserveSource(SilentDevice(backend, PAGE)), zero_on_map="fresh")
    PagePool(backend, ReserveSource(SilentDevice(backend, PAGE)), zero_on_map=True).close()


def test_the_device_layer_checks_the_page_size_against_the_backend():
    with pytest.raises(PoolError, match="not a positive multiple of the host granularity"):
        DeviceSource(HostBackend(), 1000)


class CallsSeen(LimitedSource):
    """A limit that also notes the size of every call it gets (pages per acquire, per release)."""

    def __init__(self, upstream: PageSource, limit_bytes: int | None = None):
        super().__init__(upstream, limit_bytes)
        self.acquires: list[int] = []
        self.releases: list[int] = []

    def acquire(self, count: int, *, force: bool = False) -> list:
        self.acquires.append(count)
        return super().acquire(count, force=force)

    def release(self, handles: list) -> None:
        self.releases.append(len(handles))
        super().release(handles)


def test_the_reserve_grows_and_trims_a_batch_per_call_and_still_reaches_the_limits_last_page():
    """One call upstream per batch (a shared account's file transaction each), not one per page."""
    backend = HostBackend()
    calls = CallsSeen(DeviceSource(backend, PAGE), 11 * PAGE)
    reserve = ReserveSource(calls, batch_bytes=4 * PAGE)
    assert reserve.grow(20) == 11
    assert calls.acquires == [4, 4, 4, 2, 2, 1, 1]  # a refused batch halves, down to the last page
    assert calls.outstanding_bytes == 11 * PAGE

    turns = iter([False, True])
    assert reserve.trim(2, stop=lambda: next(turns)) == 8  # in turns: a batch between two looks
    assert calls.releases == [4, 4]
    assert reserve.trim(0) == 3 and calls.releases == [4, 4, 3]  # at once: one call
    assert calls.outstanding_bytes == 0
