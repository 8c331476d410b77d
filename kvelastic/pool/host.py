"""Host-memory twin of the CUDA backend, so every line of pool logic runs on a CPU.

A reservation is an ``mmap`` with no access rights. A physical page is a
``memfd`` of the page size, committed with ``fallocate`` (like ``cuMemCreate``
it takes real memory before it is mapped). Mapping places the memfd at a fixed
address with read/write rights; unmapping puts the no-access reservation back.
Resident memory therefore rises when pages are mapped and touched, and falls
when they are unmapped, exactly as the tests expect of the GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from typing import TYPE_CHECKING, Any, Sequence

from kvelastic.errors import BackendUnavailable, DeviceOutOfMemory, PoolError
from kvelastic.pool.backend import MapRun, PhysicalBackend

if TYPE_CHECKING:
    import torch

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_PROT_NONE = 0


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


class HostPage:
    """One physical host page: a memfd holding ``nbytes`` of committed memory."""

    __slots__ = ("fd", "nbytes")

    def __init__(self, fd: int, nbytes: int):
        self.fd = fd
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"HostPage(fd={self.fd}, nbytes={self.nbytes})"


class HostBackend(PhysicalBackend):
    """Physical pages from process memory (Linux: memfd + mmap)."""

    name = "host"

    def __init__(self, max_bytes: int | None = None):
        """``max_bytes`` emulates a device of that size: creating past it raises DeviceOutOfMemory."""
        if not hasattr(os, "memfd_create"):
            raise BackendUnavailable("the host backend needs Linux memfd_create")
        self._libc = _load_libc()
        self._max_bytes = max_bytes
        self._created_bytes = 0

    @property
    def granularity(self) -> int:
        return mmap.PAGESIZE

    def _mmap(self, address: int, nbytes: int, prot: int, flags: int, fd: int) -> int:
        result = self._libc.mmap(address or None, nbytes, prot, flags, fd, 0)
        if result in (None, _MAP_FAILED):
            code = ctypes.get_errno()
            if code == errno.ENOMEM:
                raise DeviceOutOfMemory(f"host mmap of {nbytes} bytes: out of memory",
                                        requested_bytes=nbytes)
            raise PoolError(f"host mmap of {nbytes} bytes failed: {os.strerror(code)}")
        return int(result)

    def reserve_address(self, nbytes: int) -> int:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        return self._mmap(0, nbytes, _PROT_NONE, flags, -1)

    def free_address(self, address: int, nbytes: int) -> None:
        if self._libc.munmap(address, nbytes) != 0:
            raise PoolError(f"munmap failed: {os.strerror(ctypes.get_errno())}")

    def create_page(self, nbytes: int) -> HostPage:
        if self._max_bytes is not None and self._created_bytes + nbytes > self._max_bytes:
            raise DeviceOutOfMemory(
                f"host backend is limited to {self._max_bytes} bytes and holds {self._created_bytes}",
                requested_bytes=nbytes, available_bytes=self._max_bytes - self._created_bytes)
        fd = os.memfd_create("kvelastic-page", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            if self._libc.fallocate(fd, 0, 0, nbytes) != 0:
                code = ctypes.get_errno()
                raise DeviceOutOfMemory(f"host page of {nbytes} bytes: {os.strerror(code)}",
                                        requested_bytes=nbytes)
        except BaseException:
            os.close(fd)
            raise
        self._created_bytes += nbytes
        return HostPage(fd, nbytes)

    def release_page(self, handle: HostPage) -> None:
        os.close(handle.fd)
        self._created_bytes -= handle.nbytes

    def map_runs(self, runs: Sequence[MapRun], page_bytes: int, *, zero: bool) -> None:
        done: list[tuple[int, int]] = []
        try:
            for run in runs:
                for i, handle in enumerate(run.handles):
                    address = run.address + i * page_bytes
                    self._mmap(address, page_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                               mmap.MAP_SHARED | _MAP_FIXED, handle.fd)
                    done.append((address, page_bytes))
                if zero:
                    ctypes.memset(run.address, 0, len(run.handles) * page_bytes)
        except BaseException:
            for address, nbytes in done:
                self.unmap(address, nbytes)
            raise

    def unmap(self, address: int, nbytes: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        self._mmap(address, nbytes, _PROT_NONE, flags, -1)

    def tensor_view(self, address: int, nbytes: int, owner: object) -> "torch.Tensor":
        import torch

        buffer = _OwnedBuffer.at(address, nbytes, owner)
        return torch.frombuffer(buffer, dtype=torch.int8, count=nbytes)

    def device_free_bytes(self) -> int | None:
        if self._max_bytes is None:
            return None
        return self._max_bytes - self._created_bytes


class _OwnedBuffer:
    """Builds writable ctypes buffers that keep their pool owner alive.

    torch.frombuffer holds a reference to the buffer object for the tensor's
    lifetime; hanging the owner on it ties the reservation's life to the tensor's.
    """

    @staticmethod
    def at(address: int, nbytes: int, owner: object) -> Any:
        array_type = type("KvelasticHostBuffer", (ctypes.c_int8 * nbytes,), {})
        buffer = array_type.from_address(address)
        buffer.owner = owner
        return buffer
