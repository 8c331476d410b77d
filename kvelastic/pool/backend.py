"""The contract every physical-memory backend fulfils.

A backend knows how to reserve virtual address ranges, create and release
physical pages, map pages into a reservation and expose a range as a torch
tensor. Everything above it (reserve, limit, page groups, accounting) is
backend-agnostic, which is why the host backend can test all of it on a CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MapRun:
    """Physical pages to map back to back starting at ``address``.

    One run becomes one access-rights call (and one zero-fill) in the backend,
    so callers hand over the longest contiguous runs they can.
    """

    address: int
    handles: tuple[Any, ...]


class Fence(ABC):
    """Marks a point in the device's work queue; unmapping waits for it."""

    @abstractmethod
    def is_done(self) -> bool:
        """True once all work submitted before the fence has finished."""

    @abstractmethod
    def wait(self) -> None:
        """Block until :meth:`is_done` would return True."""


class DoneFence(Fence):
    """A fence that has always passed (host memory, or nothing in flight)."""

    def is_done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class PhysicalBackend(ABC):
    """Virtual reservations plus physical pages of one size, on one device."""

    #: Short name used in logs and errors ("cuda", "host").
    name: str = "abstract"

    @property
    @abstractmethod
    def granularity(self) -> int:
        """Smallest page size (bytes) the backend accepts; page sizes are multiples of it."""

    @abstractmethod
    def reserve_address(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of virtual addresses (no physical memory) and return the base."""

    @abstractmethod
    def free_address(self, address: int, nbytes: int) -> None:
        """Give back a reservation made by :meth:`reserve_address`; nothing may be mapped in it."""

    @abstractmethod
    def create_page(self, nbytes: int) -> Any:
        """Create one physical page; raise :class:`DeviceOutOfMemory` when none can be had."""

    @abstractmethod
    def release_page(self, handle: Any) -> None:
        """Destroy a page created by :meth:`create_page` (it must not be mapped)."""

    @abstractmethod
    def map_runs(self, runs: Sequence[MapRun], page_bytes: int, *, zero: bool) -> None:
        """Map every run's pages, make them read/write, and zero them if ``zero``.

        All or nothing: on failure, whatever this call mapped is unmapped again.
        """

    @abstractmethod
    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap the pages covering ``[address, address + nbytes)``; the pages survive."""

    @abstractmethod
    def tensor_view(self, address: int, nbytes: int, owner: object) -> "torch.Tensor":
        """A flat int8 tensor over ``[address, address + nbytes)`` that keeps ``owner`` alive."""

    def use_page_size(self, page_bytes: int) -> None:
        """Told once by the pool before any reservation, so ranges can be aligned to pages."""

    def record_fence(self) -> Fence:
        """A fence after all work queued so far; the default has nothing to wait for."""
        return DoneFence()

    def device_free_bytes(self) -> int | None:
        """Physical bytes the device could still give, or None when unknown."""
        return None

    def synchronize(self) -> None:
        """Wait for all queued device work (no-op where work is synchronous)."""

    def close(self) -> None:
        """Release backend-wide resources (streams, events); pages must already be gone."""
