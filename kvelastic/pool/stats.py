"""The pool's statistics: a counting layer for its source stack, and a snapshot of its accounting."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from kvelastic.pool.sources import PageAdaptor, PageSource, SourceReport


class StatisticsSource(PageAdaptor):
    """Counts the pages that pass through it, like RMM's statistics adaptor.

    Inserted right above the device it counts the pages created; the pool
    reports that count as ``pages_created``.
    """

    def __init__(self, upstream: PageSource):
        super().__init__(upstream)
        self.acquired_pages = 0
        self.released_pages = 0

    def acquire(self, count: int, *, force: bool = False) -> list[Any]:
        handles = self.upstream.acquire(count, force=force)
        self.acquired_pages += len(handles)
        return handles

    def release(self, handles: list[Any]) -> None:
        self.upstream.release(handles)
        self.released_pages += len(handles)

    @property
    def outstanding_bytes(self) -> int:
        return (self.acquired_pages - self.released_pages) * self.page_bytes

    def report(self) -> SourceReport:
        return replace(self.upstream.report(), pages_created=self.acquired_pages)


@dataclass(frozen=True)
class PoolStats:
    """Bytes and counts of one page pool at one instant.

    ``held_bytes`` is every physical byte the pool owns: mapped pages, pages
    waiting for a fence before they are unmapped, and the warm reserve. The
    limit applies to it.
    """

    page_bytes: int
    virtual_bytes: int
    mapped_bytes: int
    pending_unmap_bytes: int
    reserve_bytes: int
    held_bytes: int
    limit_bytes: int | None
    groups_mapped: int
    num_groups: int
    pages_created: int
    reserve_hits: int
    reserve_misses: int

    @property
    def over_limit_bytes(self) -> int:
        """Bytes that must be unmapped to get back under a lowered limit."""
        if self.limit_bytes is None:
            return 0
        return max(0, self.held_bytes - self.limit_bytes)

    def as_dict(self) -> dict[str, int | None]:
        data = asdict(self)
        data["over_limit_bytes"] = self.over_limit_bytes
        return data
