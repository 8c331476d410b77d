"""A virtual address reservation exposed as one tensor.

The tensor keeps a small lease object alive; when the last view of the tensor
dies the lease's finalizer tells the pool, which can then unmap and free the
range. That ties the reservation's life to what vLLM actually holds, so a
short-lived profiling cache does not leak virtual or physical memory.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable


class RegionLease:
    """The object a region's tensor keeps alive; nothing else should reference it."""

    __slots__ = ("region_id", "__weakref__")

    def __init__(self, region_id: int):
        self.region_id = region_id


@dataclass
class Region:
    """One reservation: ``nbytes`` usable bytes at ``address``, padded to whole pages."""

    region_id: int
    address: int
    nbytes: int
    reserved_bytes: int
    page_bytes: int
    alive: bool = True
    lease_ref: "weakref.ref[RegionLease] | None" = field(default=None, repr=False)

    @property
    def num_pages(self) -> int:
        return self.reserved_bytes // self.page_bytes

    def page_address(self, page: int) -> int:
        return self.address + page * self.page_bytes

    def watch(self, lease: RegionLease, on_dead: Callable[[int], None]) -> None:
        """Call ``on_dead(region_id)`` once ``lease`` is garbage collected."""
        self.lease_ref = weakref.ref(lease)
        weakref.finalize(lease, on_dead, self.region_id)

    def tensor_alive(self) -> bool:
        return self.lease_ref is not None and self.lease_ref() is not None
