"""A consistent snapshot of the pool's accounting, cheap to take at any time."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
