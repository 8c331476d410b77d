"""The pool's warm pages: growing and trimming the reserve, and parking it where maps will look.

Part of :class:`~kvelastic.pool.page_pool.PagePool` (a base class of it, kept apart for size): it
reads and writes the pool's books under the pool's lock. Growing and trimming are the upkeep
thread's work, never urgent, and run in turns: between two batches of pages
(:data:`~kvelastic.pool.sources.BATCH_BYTES`, or two parked groups) they step aside for a thread
that waits for the lock, a map the scheduler may be waiting for. On an H200 a 256 MiB
chunk of growth held the lock 6-20 ms and a trim 20-31 ms beside a busy engine, and the mapper
waited behind them; in turns it waits for one batch's driver calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Any, Callable

from kvelastic.pool.layout import GroupLayout, PageRef
from kvelastic.pool.lock_waits import CountedLock
from kvelastic.pool.parking import ParkingLot
from kvelastic.pool.sources import ReserveSource


#: Groups parked in one batch of driver calls when parking in turns. Neighbouring groups' pages in
#: one tensor map as one run (one access call and one zero-fill), so a batch of a few small groups
#: (the 1B shape's are 32 MiB) makes fewer calls than one group at a time; the 8B shape's groups
#: (256 MiB) go one by one.
PARK_BATCH_BYTES = 128 * 1024 * 1024


def _batches(chosen: list[tuple[int, list[PageRef]]], pages: int) -> list[list[tuple[int, list[PageRef]]]]:
    """``chosen`` groups cut into batches of about ``pages`` pages (at least one group each)."""
    batches: list[list[tuple[int, list[PageRef]]]] = []
    size = pages  # start a new batch at the first group
    for group in chosen:
        if size >= pages:
            batches.append([])
            size = 0
        batches[-1].append(group)
        size += len(group[1])
    return batches


class WarmPages:
    """Grows, trims and parks the pool's warm reserve (the pool's attributes, declared below)."""

    page_bytes: int
    _lock: CountedLock
    _reserve: ReserveSource
    _parking: ParkingLot
    _park: bool
    _mapped_groups: set[int]
    _handles: dict[PageRef, Any]

    if TYPE_CHECKING:
        @property
        def layout(self) -> GroupLayout: ...
        def _check_open(self) -> None: ...
        def _live_pages(self, layout: GroupLayout, group: int) -> list[PageRef]: ...
        def _place(self, refs: list[PageRef], handles: list[Any]) -> None: ...
        def _unmap_pages(self, refs: list[PageRef]) -> None: ...

    def grow_reserve(self, pages: int) -> int:
        """Create up to ``pages`` warm pages ahead of demand, within the limit; return how many.

        Then park the warm pages (new and recycled) at the lowest unmapped
        groups they fill whole, so mapping those groups later costs no driver
        call. Call it off the hot path; ``grow_reserve(0)`` only parks. A thread
        that waits for the lock meanwhile (a map the scheduler waits for) goes
        first after the batch of pages or parked group in hand (:meth:`CountedLock.others_waiting`).
        """
        added = 0
        while True:
            with self._lock:
                self._check_open()
                step_aside = self._lock.others_waiting
                got = self._reserve.grow(pages - added, stop=step_aside)
                added += got
                parked = self._park_locked(stop=step_aside)
                if not ((got or parked) and step_aside()):
                    return added
            self._lock.let_waiters_in()

    def trim_reserve(self, keep_pages: int = 0) -> int:
        """Give warm pages (parked ones included) beyond ``keep_pages`` back to the device, stepping
        aside between batches of pages (or parked groups) for threads waiting for the lock, as growth does."""
        gone = 0
        while True:
            with self._lock:
                step_aside = self._lock.others_waiting
                over = self._parking.pages - keep_pages
                unparked = self._unpark_locked(over, stop=step_aside) if over > 0 else 0
                released = 0
                if not (unparked and step_aside()):
                    released = self._reserve.trim(max(0, keep_pages - self._parking.pages), stop=step_aside)
                gone += released
                if not ((unparked or released) and step_aside()):
                    return gone
            self._lock.let_waiters_in()

    def parked_groups(self) -> frozenset[int]:
        """Unmapped groups whose pages are mapped ahead (counted as warm reserve, not as mapped)."""
        with self._lock:
            return self._parking.groups()

    def headroom_estimate(self, device_free: int | None) -> int | None:
        """Bytes that could be mapped now; lock-free, for hot paths that tolerate a stale answer.

        The warm reserve plus what every limit in the stack and ``device_free``
        (a recent reading of the device's free bytes, or None) still allow.
        """
        room = self._reserve.headroom_bytes(device_free)
        return None if room is None else room + self._parking.pages * self.page_bytes

    def _park_locked(self, stop: Callable[[], bool]) -> int:
        """Map the reserve's spare pages at the lowest unmapped groups they fill whole, a batch of
        groups (:data:`PARK_BATCH_BYTES`) at a time until ``stop()`` says so after one."""
        spare = self._reserve.cached_pages
        if not spare or not self._park:
            return 0
        layout = self.layout
        chosen = self._parking.choose(layout, spare, lambda g: self._live_pages(layout, g),
                                      lambda g, ref: g not in self._mapped_groups and ref not in self._handles)
        parked = 0
        for batch in _batches(chosen, max(1, PARK_BATCH_BYTES // self.page_bytes)):
            refs = [ref for _, group_refs in batch for ref in group_refs]
            if refs:
                self._place(refs, self._reserve.acquire(len(refs)))
            for group, group_refs in batch:
                self._parking.park(group, group_refs)
            parked += len(refs)
            if stop():
                break
        return parked

    def _unpark_locked(self, count: int | None = None, keep: AbstractSet[PageRef] = frozenset(),
                       stop: Callable[[], bool] | None = None) -> int:
        """Unmap parked groups (highest first) until ``count`` pages are back in the reserve (None: all);
        with ``stop``, a group at a time until ``stop()`` says so after one."""
        freed = 0
        while count is None or freed < count:
            refs = self._parking.evict(None if count is None else count - freed, keep=keep,
                                       max_groups=None if stop is None else 1)
            if not refs:
                break
            self._unmap_pages(refs)
            freed += len(refs)
            if stop is not None and stop():
                break
        return freed
