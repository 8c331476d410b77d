"""Warm pages parked where they will be needed: the bookkeeping of pre-mapped, unused groups.

Mapping costs the driver a fixed few tens of microseconds per page whatever its
size (``cuMemMap`` plus ``cuMemSetAccess``; measured on an H100, docs/gpu-results.md),
so growing an 8B model's pool by 1 GiB of 8 MiB pages costs ~4.4 ms even when
the pages already exist. The pool therefore maps its warm reserve ahead of
time, off the scheduler's path (the upkeep thread grows the reserve), at the
unmapped groups the scheduler asks for next: vLLM's free list hands out the
lowest unmapped group first. A map call that wants a parked group only adopts
its pages; one that wants another group takes pages from the reserve as
before, unparking only if the reserve has none to give.

A parked page is owned and counted as warm reserve, never as mapped, so the
limit, the shared account and the statistics see the same bytes as before.
This module only keeps the books; :class:`~kvelastic.pool.page_pool.PagePool`
makes the driver calls.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Iterable

from kvelastic.pool.layout import GroupLayout, PageRef


class ParkingLot:
    """Which unmapped groups have their pages mapped already, and by which pages."""

    def __init__(self) -> None:
        self._groups: dict[int, list[PageRef]] = {}
        self._owner: dict[PageRef, int] = {}

    @property
    def pages(self) -> int:
        """Pages parked now (read without the pool's lock by the headroom estimate: a stale answer is fine)."""
        return len(self._owner)

    def groups(self) -> frozenset[int]:
        return frozenset(self._groups)

    def choose(self, layout: GroupLayout, spare_pages: int, live_pages: Callable[[int], list[PageRef]],
               is_free: Callable[[int, PageRef], bool]) -> list[tuple[int, list[PageRef]]]:
        """The lowest groups, with their pages, that ``spare_pages`` warm pages can park whole.

        ``is_free(group, ref)``: the group is unmapped and the page belongs to no mapped,
        pending or parked group. Groups sharing a page with one chosen are skipped.
        """
        chosen: list[tuple[int, list[PageRef]]] = []
        claimed: set[PageRef] = set()
        for group in range(layout.num_groups):
            if spare_pages <= 0:
                break
            if group in self._groups:
                continue
            refs = live_pages(group)
            if len(refs) > spare_pages:
                break  # groups are about the same size: the next will not fit either
            if not refs:
                continue
            if any(ref in claimed or not is_free(group, ref) for ref in refs):
                continue
            chosen.append((group, refs))
            claimed.update(refs)
            spare_pages -= len(refs)
        return chosen

    def park(self, group: int, refs: list[PageRef]) -> None:
        self._groups[group] = list(refs)
        for ref in refs:
            self._owner[ref] = group

    def adopt(self, wanted: Iterable[PageRef]) -> list[PageRef]:
        """Hand parked pages in ``wanted`` over to mapped groups; return their groups' other pages.

        Those strays belong to no group any more and go back to the reserve.
        """
        if not self._owner:
            return []
        wanted = set(wanted)
        groups = {self._owner[ref] for ref in wanted if ref in self._owner}
        strays: list[PageRef] = []
        for group in groups:
            for ref in self._groups.pop(group):
                del self._owner[ref]
                if ref not in wanted:
                    strays.append(ref)
        return strays

    def evict(self, count: int | None = None, keep: AbstractSet[PageRef] = frozenset(),
              max_groups: int | None = None) -> list[PageRef]:
        """Forget the highest parked groups until ``count`` pages are freed (None: all), or
        ``max_groups`` groups went; return their pages. Groups holding a page in ``keep`` stay parked.
        """
        freed: list[PageRef] = []
        gone = 0
        for group in sorted(self._groups, reverse=True):
            if (count is not None and len(freed) >= count) or (max_groups is not None and gone >= max_groups):
                break
            if keep and any(ref in keep for ref in self._groups[group]):
                continue
            for ref in self._groups.pop(group):
                del self._owner[ref]
                freed.append(ref)
            gone += 1
        return freed
