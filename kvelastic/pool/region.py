"""A virtual address reservation exposed as one tensor.

The tensor keeps a small lease object alive; when the last view of the tensor
dies the lease's finalizer tells the pool, which can then unmap and free the
range. That ties the reservation's life to what vLLM actually holds, so a
short-lived profiling cache does not leak virtual or physical memory.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from kvelastic.errors import PoolError
from kvelastic.units import align_up

if TYPE_CHECKING:
    import torch

    from kvelastic.pool.backend import PhysicalBackend


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


class RegionTable(dict[int, Region]):
    """A pool's live reservations by id, and the ids of those whose tensor died (``dead``, for the pool
    to free under its lock: a finalizer may run on any thread, so it only appends)."""

    def __init__(self) -> None:
        super().__init__()
        self._next_id = 0
        self.dead: deque[int] = deque()

    def reserve(self, backend: "PhysicalBackend", nbytes: int, page_bytes: int) -> "torch.Tensor":
        """Reserve ``nbytes`` (padded to whole pages) and return a flat int8 tensor over them."""
        reserved = align_up(nbytes, page_bytes)
        address = backend.reserve_address(reserved)
        region = Region(self._next_id, address, nbytes, reserved, page_bytes)
        self._next_id += 1
        lease = RegionLease(region.region_id)
        tensor = backend.tensor_view(address, nbytes, lease)
        region.watch(lease, self.dead.append)
        self[region.region_id] = region
        return tensor

    @staticmethod
    def view_of(backend: "PhysicalBackend", region: Region) -> "torch.Tensor":
        """Another flat int8 view of ``region``; it keeps the region alive like the original tensor."""
        lease = region.lease_ref() if region.lease_ref is not None else None
        if lease is None or not region.alive:
            raise PoolError(f"region {region.region_id} has no live tensor")
        return backend.tensor_view(region.address, region.nbytes, lease)

    def containing(self, pointer: int) -> Region:
        for region in self.values():
            if region.address <= pointer < region.address + region.reserved_bytes:
                return region
        raise PoolError(f"address {pointer:#x} is not in any region of this pool")
