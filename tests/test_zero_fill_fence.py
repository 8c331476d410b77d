"""An unmap never pulls a page from under its own queued zero-fill.

On CUDA a zero-fill is queued behind whatever the device is running and not
waited for. Unmapping the page before the fill ran makes the fill write to an
unmapped address, which kills the context (CUDA_ERROR_ILLEGAL_ADDRESS, seen on an H200
when a freshly grown reserve was trimmed beside busy kernels). The host backend fills synchronously, so these tests use a host
backend whose fills run late, as a busy device's do: only when a fence recorded
after them is waited for. Unmapping a range with a fill still queued is the
device's fault, raised here as the driver would.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import pytest
import torch

from kvelastic.pool import Fence, HostBackend, PagePool
from kvelastic.pool.backend import MapRun
from tests.conftest import SMALL_PAGE


class IllegalAddress(RuntimeError):
    """A queued fill found its page unmapped."""


class QueueFence(Fence):
    """Done once the fills queued before it ran: they run when it is waited for."""

    def __init__(self, backend: "LateFillBackend", upto: int):
        self.backend = backend
        self.upto = upto

    def is_done(self) -> bool:
        return self.backend.filled_upto >= self.upto

    def wait(self) -> None:
        self.backend.run_fills(self.upto)


class LateFillBackend(HostBackend):
    """Host pages whose zero-fills wait in a queue, as on a busy GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.fills: list[tuple[int, int]] = []  # (address, bytes), in queue order
        self.filled_upto = 0
        self.waits = 0  # fence waits that had queued fills to run

    def map_runs(self, runs: Sequence[MapRun], page_bytes: int, *, zero: bool) -> None:
        super().map_runs(runs, page_bytes, zero=False)
        if zero:
            self.fills.extend((run.address, len(run.handles) * page_bytes) for run in runs)

    def record_fence(self) -> Fence:
        return QueueFence(self, len(self.fills))

    def run_fills(self, upto: int) -> None:
        if upto <= self.filled_upto:
            return
        self.waits += 1
        for address, nbytes in self.fills[self.filled_upto:upto]:
            ctypes.memset(address, 0, nbytes)
        self.filled_upto = max(self.filled_upto, upto)

    def unmap(self, address: int, nbytes: int) -> None:
        for fill_address, fill_bytes in self.fills[self.filled_upto:]:
            if fill_address < address + nbytes and address < fill_address + fill_bytes:
                raise IllegalAddress(f"unmap of {address:#x} under a queued fill of {fill_address:#x}")
        super().unmap(address, nbytes)

    def synchronize(self) -> None:
        self.run_fills(len(self.fills))


@pytest.fixture(params=["fresh", True])
def late_pool(request):
    backend = LateFillBackend()
    pool = PagePool.standard(backend, page_bytes=SMALL_PAGE, zero_on_map=request.param)
    yield pool, backend
    pool.close()
    assert pool.leak_report() == []


def test_a_reserve_trimmed_right_after_it_grew_waits_for_its_fills(late_pool):
    pool, backend = late_pool
    tensors = [pool.add_tensor(8 * SMALL_PAGE) for _ in range(2)]
    assert pool.grow_reserve(6) == 6 and pool.parked_groups() == frozenset({0, 1, 2})
    assert backend.filled_upto < len(backend.fills)  # the parked pages' fills are still queued
    pool.trim_reserve(0)
    assert pool.stats().held_bytes == 0 and backend.waits == 1
    del tensors


def test_a_group_unmapped_without_a_fence_right_after_its_map_waits_for_its_fill(late_pool):
    pool, backend = late_pool
    tensor = pool.add_tensor(4 * SMALL_PAGE)
    pool.map_groups([1])
    pool.unmap_groups([1])
    assert not pool.is_mapped(1) and backend.waits == 1
    del tensor


def test_an_unmap_after_the_fill_ran_or_of_a_page_never_filled_does_not_wait(late_pool):
    pool, backend = late_pool
    tensor = pool.add_tensor(4 * SMALL_PAGE)
    pool.map_groups([0])
    backend.run_fills(len(backend.fills))  # the device caught up by itself
    waits = backend.waits
    pool.unmap_groups([0])
    assert backend.waits == waits
    del tensor


def test_a_recycled_page_under_fresh_zeroing_is_unmapped_at_once():
    backend = LateFillBackend()
    pool = PagePool.standard(backend, page_bytes=SMALL_PAGE, zero_on_map="fresh")
    tensor = pool.add_tensor(4 * SMALL_PAGE)
    pool.map_groups([0])
    backend.synchronize()  # the fill ran before the write, as on the device's stream
    waits = backend.waits
    tensor[:SMALL_PAGE] = 7
    pool.unmap_groups([0])
    pool.map_groups([2])  # the same page again: no fill, its old data kept
    assert torch.all(tensor[2 * SMALL_PAGE:3 * SMALL_PAGE] == 7)
    pool.unmap_groups([2])
    assert backend.waits == waits
    del tensor
    pool.close()


def test_pages_read_as_zero_once_their_fill_ran(late_pool):
    pool, backend = late_pool
    tensor = pool.add_tensor(4 * SMALL_PAGE)
    pool.map_groups([0])
    backend.synchronize()
    tensor[:SMALL_PAGE] = 5
    pool.unmap_groups([0], fence=backend.record_fence())
    pool.collect(wait=True)
    pool.map_groups([3])
    backend.synchronize()
    expect_zero = pool._placer.zero_on_map is True  # "fresh" keeps a recycled page's data
    assert bool(torch.all(tensor[3 * SMALL_PAGE:] == 0)) is expect_zero
    del tensor
