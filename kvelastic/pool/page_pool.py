"""The elastic page pool: virtual tensors whose physical pages come and go.

Tensors are reserved up front; physical pages are mapped a group at a time
(group g = the pages the layout assigns to g, by default page g of every
tensor) and unmapped when the caller is done with them. Unmapping can wait on
a fence so pages the GPU may still read are never pulled from under a kernel.
Physical pages come from a stack of page sources the caller builds
(:mod:`kvelastic.pool.sources`) whose top is a warm reserve, so the hot path
maps without creating; a limit in the stack, which can change while the pool
runs, caps every physical byte the pool holds. Growing the reserve also parks
it (:mod:`kvelastic.pool.parking`): warm pages are mapped ahead at the groups
asked for next, so the hot path often makes no driver call at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from kvelastic.errors import PoolClosedError, PoolError, PoolExhausted
from kvelastic.pool.backend import Fence, PhysicalBackend
from kvelastic.pool.fenced_unmaps import FencedUnmaps
from kvelastic.pool.layout import GroupLayout, PageRef, UniformLayout
from kvelastic.pool.lock_waits import CountedLock, LockWaits
from kvelastic.pool.parking import ParkingLot
from kvelastic.pool.placement import PagePlacer
from kvelastic.pool.region import Region, RegionTable
from kvelastic.pool.sources import DeviceSource, LimitedSource, ReserveSource
from kvelastic.pool.stats import PoolStats, StatisticsSource
from kvelastic.pool.warm_pages import WarmPages
from kvelastic.roles import PoolView

if TYPE_CHECKING:
    import torch

DEFAULT_PAGE_BYTES = 2 * 1024 * 1024


class PagePool(WarmPages, PoolView):
    """Tensors over reserved virtual memory, backed page group by page group.

    The scheduler side sees it through the :class:`~kvelastic.roles.PoolView` role.
    """

    def __init__(self, backend: PhysicalBackend, source: ReserveSource, *, zero_on_map: bool | str = True,
                 park: bool = True):
        """Map pages from ``source``, the top of a stack whose root creates pages on ``backend``.

        ``zero_on_map``: True zeroes every page as it is mapped (torch.zeros semantics);
        ``"fresh"`` zeroes only pages never mapped before by this pool (recycled pages
        keep this pool's own old data, as reused vLLM blocks do); False never zeroes.
        ``park``: map the warm reserve ahead at the groups asked for next
        (:mod:`kvelastic.pool.parking`); False keeps warm pages unmapped.
        """
        self.backend = backend
        self.page_bytes = source.page_bytes
        self._placer = PagePlacer(backend, self.page_bytes, zero_on_map, self._page_address)
        backend.use_page_size(self.page_bytes)
        self._reserve = source
        if zero_on_map == "fresh":
            source.watch_destroyed(self._placer.forget)
        self._lock = CountedLock()
        self._regions = RegionTable()
        self._layout: GroupLayout | None = None
        self._mapped_groups: set[int] = set()
        self._page_refs: dict[PageRef, int] = {}
        self._handles: dict[PageRef, Any] = {}
        self._pending = FencedUnmaps()
        self._parking = ParkingLot()
        self._park = park
        self._closed = False

    @classmethod
    def standard(cls, backend: PhysicalBackend, *, page_bytes: int = DEFAULT_PAGE_BYTES,
                 limit_bytes: int | None = None, zero_on_map: bool | str = True, park: bool = True) -> "PagePool":
        """A pool over the usual stack: a reserve over a limit over pages counted as created."""
        device = StatisticsSource(DeviceSource(backend, page_bytes))
        return cls(backend, ReserveSource(LimitedSource(device, limit_bytes)), zero_on_map=zero_on_map, park=park)

    # ----------------------------------------------------------------- tensors
    def add_tensor(self, nbytes: int) -> "torch.Tensor":
        """Reserve ``nbytes`` of virtual memory and return a flat int8 tensor over it.

        Nothing is mapped yet: touching the tensor before its groups are mapped
        faults, exactly like reading freed device memory.
        """
        if nbytes <= 0:
            raise PoolError(f"tensor size must be positive, got {nbytes}")
        with self._lock:
            self._check_open()
            return self._regions.reserve(self.backend, nbytes, self.page_bytes)

    def view_of(self, region: Region) -> "torch.Tensor":
        """Another flat int8 view of ``region``; it keeps the region alive like the original tensor."""
        return RegionTable.view_of(self.backend, region)

    def region_of(self, tensor: "torch.Tensor") -> Region:
        """The region a tensor (or a view of it) lives in."""
        with self._lock:
            return self._regions.containing(tensor.data_ptr())

    def regions_alive(self) -> int:
        """How many regions still have a live tensor (dead ones are retired first)."""
        with self._lock:
            if self._closed:
                return 0
            self._check_open()
            return len(self._regions)

    @property
    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    # ------------------------------------------------------------------ layout
    @property
    def layout(self) -> GroupLayout:
        with self._lock:
            if self._layout is not None:
                return self._layout
            return UniformLayout({r.region_id: r.num_pages for r in self._regions.values()})

    def set_layout(self, layout: GroupLayout) -> None:
        """Replace the group layout; allowed only while no group is mapped."""
        with self._lock:
            if self._mapped_groups:
                raise PoolError("the layout can change only while no group is mapped")
            self._unpark_locked()
            self._layout = layout

    # ----------------------------------------------------------- map / unmap
    def map_groups(self, groups: Iterable[int], *, force: bool = False) -> int:
        """Map every group in ``groups`` that is not mapped yet; return how many were new.

        All or nothing: if the limit or the device refuses, nothing changes and
        :class:`PoolExhausted` (or a subclass) is raised. ``force`` goes past the
        limit (and any budget above the device), never past the device itself.
        """
        with self._lock:
            self._check_open()
            self._collect_locked(wait=False)
            layout = self.layout
            new_groups = sorted({g for g in groups if g not in self._mapped_groups})
            if not new_groups:
                return 0
            wanted = self._pages_to_back(layout, new_groups)
            fresh = [ref for ref in wanted if ref not in self._handles]
            self._place(fresh, self._acquire(len(fresh), force, wanted))  # none fresh: all parked or fenced
            strays = self._parking.adopt(wanted)
            if strays:
                self._unmap_pages(strays)
            self._pending.revive(wanted)
            for group in new_groups:
                for ref in self._live_pages(layout, group):
                    self._page_refs[ref] = self._page_refs.get(ref, 0) + 1
            self._mapped_groups.update(new_groups)
            return len(new_groups)

    def unmap_groups(self, groups: Iterable[int], fence: Fence | None = None) -> int:
        """Give back the pages of mapped ``groups``; return how many groups were unmapped.

        With a ``fence``, pages stay physically mapped (and counted) until the
        fence passes; :meth:`collect` or any later pool call finishes the job.
        """
        with self._lock:
            self._check_open()
            layout = self.layout
            released: list[PageRef] = []
            count = 0
            for group in set(groups):
                if group not in self._mapped_groups:
                    continue
                self._mapped_groups.discard(group)
                count += 1
                for ref in self._live_pages(layout, group):
                    left = self._page_refs[ref] - 1
                    if left:
                        self._page_refs[ref] = left
                    else:
                        del self._page_refs[ref]
                        released.append(ref)
            if fence is None or fence.is_done():
                self._unmap_pages(released)
            else:
                self._pending.add(fence, released)
            self._collect_locked(wait=False)
            return count

    def is_mapped(self, group: int) -> bool:
        with self._lock:
            return group in self._mapped_groups

    def num_mapped_groups(self) -> int:
        with self._lock:
            return len(self._mapped_groups)

    def mapped_groups(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._mapped_groups)

    def collect(self, wait: bool = False) -> int:
        """Finish fenced unmaps whose fence has passed (all of them if ``wait``)."""
        with self._lock:
            if self._closed:
                return 0
            return self._collect_locked(wait)

    # ------------------------------------------------------- limit, reserve
    def set_limit(self, limit_bytes: int | None) -> int:
        """Change the physical-byte limit; return the bytes still over it after trimming the reserve."""
        with self._lock:
            self._reserve.set_limit(limit_bytes)
            excess = self._reserve.excess_bytes()
            if excess and self._parking.pages:
                self._unpark_locked(-(-excess // self.page_bytes))
            self._collect_locked(wait=False)
            return self.stats().over_limit_bytes

    def lock_waits(self) -> LockWaits:
        """The waits of this pool's callers for its lock so far (read without taking it)."""
        return self._lock.waits()

    def stats(self) -> PoolStats:
        with self._lock:
            report = self._reserve.report()
            owned = len(self._handles) * self.page_bytes  # mapped, parked or waiting for a fence
            pending = len(self._pending) * self.page_bytes
            parked = self._parking.pages * self.page_bytes
            cached = report.reserve_pages * self.page_bytes
            return PoolStats(
                page_bytes=self.page_bytes,
                virtual_bytes=sum(r.reserved_bytes for r in self._regions.values()),
                mapped_bytes=owned - pending - parked, pending_unmap_bytes=pending,
                reserve_bytes=cached + parked, held_bytes=owned + cached, limit_bytes=report.limit_bytes,
                groups_mapped=len(self._mapped_groups), num_groups=self.layout.num_groups,
                pages_created=report.pages_created,
                reserve_hits=report.reserve_hits, reserve_misses=report.reserve_misses)

    # --------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Unmap everything, release every page and every reservation."""
        with self._lock:
            if self._closed:
                return
            self.backend.synchronize()
            self._parking.evict()
            self._unmap_pages(list(self._handles))
            self._pending.clear()
            self._page_refs.clear()
            self._mapped_groups.clear()
            self._reserve.trim(0)
            for region in self._regions.values():
                self.backend.free_address(region.address, region.reserved_bytes)
                region.alive = False
            self._regions.clear()
            self._closed = True

    def leak_report(self) -> list[str]:
        """What a closed pool still holds; an empty list means nothing leaked."""
        with self._lock:
            problems = []
            alive = self._reserve.report().device_bytes
            if alive:
                problems.append(f"{alive} bytes of pages not released")
            if self._regions:
                problems.append(f"{len(self._regions)} reservations not freed")
            if self._handles:
                problems.append(f"{len(self._handles)} pages still mapped")
            return problems

    # ---------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the page pool is closed")
        while self._regions.dead:
            self._drop_region(self._regions.dead.popleft())

    def _live_pages(self, layout: GroupLayout, group: int) -> list[PageRef]:
        return [ref for ref in layout.pages(group) if ref.region in self._regions]

    def _pages_to_back(self, layout: GroupLayout, groups: list[int]) -> list[PageRef]:
        """Pages the groups need that no mapped group holds yet (fresh or pending unmap)."""
        wanted: dict[PageRef, None] = {}
        for group in groups:
            for ref in self._live_pages(layout, group):
                if ref not in self._page_refs:
                    wanted[ref] = None
        return list(wanted)

    def _page_address(self, ref: PageRef) -> int:
        return self._regions[ref.region].page_address(ref.page)

    def _place(self, refs: list[PageRef], handles: list[Any]) -> None:
        """Map ``handles`` at ``refs``; on failure they go back to the reserve."""
        try:
            if refs:
                self._placer.map(refs, handles)
        except BaseException:
            self._reserve.release(handles)
            raise
        self._handles.update(zip(refs, handles))

    def _unmap_pages(self, refs: list[PageRef]) -> None:
        handles = [self._handles.pop(ref) for ref in refs]
        self._placer.unmap(refs, handles)
        self._pending.revive(refs)
        if handles:
            self._reserve.release(handles)  # which gives back warm pages the limit no longer allows

    def _acquire(self, count: int, force: bool, wanted: list[PageRef]) -> list[Any]:
        """Pages for a map call. If the stack says no: parked groups holding none of ``wanted`` go
        back, and then those holding some (shared pages) are adopted now, their other pages going
        back (as adoption would send them after the map). A refusal that still stands gives the
        adopted pages back too, so nothing is left owned by no group."""
        try:
            return self._reserve.acquire(count, force=force)
        except PoolExhausted:
            keep = set(wanted)
            short = count - self._reserve.cached_pages
            freed = self._unpark_locked(short, keep=keep)
            adopted: list[PageRef] = []
            if freed < short:
                strays = self._parking.adopt(keep)
                adopted = [ref for ref in wanted if ref in self._handles and ref not in self._pending]
                self._unmap_pages(strays)
                freed += len(strays)
            try:
                if not freed:
                    raise
                return self._reserve.acquire(count, force=force)
            except PoolExhausted:
                self._unmap_pages(adopted)
                raise

    def _collect_locked(self, wait: bool) -> int:
        """Unmap pages whose fence has passed."""
        ready = self._pending.ready(wait)
        self._unmap_pages(ready)
        return len(ready)

    def _drop_region(self, region_id: int) -> None:
        """The region's tensor died: wait for in-flight work, then free its pages and range."""
        region = self._regions.get(region_id)
        if region is None:
            return
        self.backend.record_fence().wait()
        self._unpark_locked()
        refs = [ref for ref in self._handles if ref.region == region_id]
        self._unmap_pages(refs)
        for ref in refs:
            self._page_refs.pop(ref, None)
        self.backend.free_address(region.address, region.reserved_bytes)
        region.alive = False
        del self._regions[region_id]
