"""Physical KV memory on a CUDA device through the driver's virtual memory API.

The pool reserves a large virtual range once and maps physical pages
(``cuMemCreate`` handles) into it on demand, so a KV tensor keeps one address
for its whole life while the memory behind it grows and shrinks. This module is
the only place that talks to the driver for that; the pool above it is the
same code the host backend runs on a CPU.

Costs measured on an H100 (see ``shared/gpu/README.md``) shape the design:
``cuMemSetAccess`` is the expensive step per page (27 us) but nearly free per
extra page when given a whole run, hence one access call and one zero-fill per
:class:`MapRun`, and one stream synchronisation per :meth:`map_runs` call.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from kvelastic.errors import BackendUnavailable, DeviceOutOfMemory, DriverError, PoolClosedError, PoolError
from kvelastic.pool import cuda_driver
from kvelastic.pool.backend import Fence, MapRun, PhysicalBackend
from kvelastic.pool.cuda_driver import check

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Idle events kept for reuse; more than this many idle at once are destroyed.
_LEGACY_DEFAULT_STREAM = 0  # the NULL stream handle: legacy default stream semantics
_MAX_POOLED_EVENTS = 256


class _DeviceBytes:
    """Exposes a device byte range through ``__cuda_array_interface__``.

    torch keeps this object alive for as long as the tensor built from it, so
    holding ``owner`` here ties the owner's life to the tensor's. There is no
    ``stream`` key on purpose: with one, torch would synchronise on every view.
    """

    def __init__(self, address: int, nbytes: int, owner: object):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|i1",
            "data": (address, False),
            "strides": None,
        }


class _EventFence(Fence):
    """A CUDA event recorded on torch's current stream; its event is recycled when collected."""

    def __init__(self, backend: "CudaBackend", event: Any):
        self._backend = backend
        self._event = event
        self._done = False

    def is_done(self) -> bool:
        if self._done:
            return True
        self._backend._bind()
        err = self._backend._driver.cuEventQuery(self._event)[0]
        if int(err) == 0:
            self._done = True
            return True
        if err == self._backend._driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        cuda_driver.raise_for("cuEventQuery", err)
        return False  # unreachable: raise_for always raises

    def wait(self) -> None:
        if self._done:
            return
        self._backend._bind()
        check("cuEventSynchronize", self._backend._driver.cuEventSynchronize(self._event))
        self._done = True

    def __del__(self) -> None:
        try:
            self._backend._recycle_event(self._event)
        except Exception:  # interpreter shutdown or a dead context: nothing useful to do
            pass


class CudaBackend(PhysicalBackend):
    """Pinned device pages on one CUDA device, mapped through the driver's VMM API."""

    name = "cuda"

    def __init__(self, device: int | None = None):
        self.device = cuda_driver.torch_device_index(device)
        self._driver = cuda_driver.driver()
        cuda_driver.init_driver()
        self._cu_device, self._context = cuda_driver.retain_primary_context(self.device)
        self._binder = cuda_driver.ContextBinder(self._context)
        self._closed = False
        self._events: list[Any] = []
        #: Page size of the mappings, used to split an unmap the driver refuses
        #: as one call. Set by :meth:`map_runs`; the pool may set it earlier.
        self.page_bytes: int | None = None
        self._ranged_unmap: bool | None = None  # None: not yet tried
        try:
            self._setup()
        except BaseException:
            cuda_driver.release_primary_context(self._cu_device)
            raise

    def _setup(self) -> None:
        """Everything after the context is retained; the caller releases it on failure."""
        d = self._driver
        self._binder.bind()
        if not cuda_driver.device_attribute(
            self._cu_device, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
        ):
            raise BackendUnavailable(f"CUDA device {self.device} does not support virtual memory management")
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        self._prop = prop
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        option = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self._granularity = int(check("cuMemGetAllocationGranularity", d.cuMemGetAllocationGranularity(prop, option)))

    # -- context ---------------------------------------------------------------------------

    def _bind(self) -> None:
        """Make the device's primary context current in this thread; refuse after close."""
        if self._closed:
            raise PoolClosedError(f"CudaBackend for device {self.device} is closed")
        self._binder.bind()

    # -- addresses and pages ---------------------------------------------------------------

    @property
    def granularity(self) -> int:
        return self._granularity

    def _alignment(self) -> int:
        """Reservation alignment: the page size when it is a power of two, else the granularity."""
        page = self.page_bytes
        if page and page >= self._granularity and page & (page - 1) == 0:
            return page
        return self._granularity

    def reserve_address(self, nbytes: int) -> int:
        self._bind()
        ptr = check("cuMemAddressReserve", self._driver.cuMemAddressReserve(nbytes, self._alignment(), 0, 0))
        return int(ptr)

    def free_address(self, address: int, nbytes: int) -> None:
        self._bind()
        check("cuMemAddressFree", self._driver.cuMemAddressFree(address, nbytes))

    def create_page(self, nbytes: int) -> int:
        """A physical page as a plain int handle (hashable, cheap to keep in pool tables)."""
        self._bind()
        try:
            handle = check("cuMemCreate", self._driver.cuMemCreate(nbytes, self._prop, 0), requested_bytes=nbytes)
        except DeviceOutOfMemory as exc:
            exc.available_bytes = self._free_bytes_or_zero()
            raise
        return int(handle)

    def release_page(self, handle: Any) -> None:
        self._bind()
        check("cuMemRelease", self._driver.cuMemRelease(handle))

    # -- mapping ---------------------------------------------------------------------------

    def use_page_size(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes

    def map_runs(self, runs: Sequence[MapRun], page_bytes: int, *, zero: bool) -> None:
        """Map, grant read/write and optionally zero every run; all or nothing.

        Zeroing is queued on the legacy default stream and not waited for: by
        that stream's semantics every later kernel on a blocking stream (vLLM's
        compute and side streams) runs after it, so the host never stalls on a
        busy GPU. A reader on a non-blocking stream must wait on a fence first.
        """
        self._bind()
        self.page_bytes = page_bytes
        mapped: list[int] = []
        try:
            for run in runs:
                self._map_run(run, page_bytes, zero, mapped)
        except BaseException:
            self._rollback(mapped, page_bytes)
            raise

    def _map_run(self, run: MapRun, page_bytes: int, zero: bool, mapped: list[int]) -> None:
        """Map one run page by page, then one access call and one memset over all of it."""
        d = self._driver
        address = run.address
        for handle in run.handles:
            check("cuMemMap", d.cuMemMap(address, page_bytes, 0, handle, 0))
            mapped.append(address)
            address += page_bytes
        nbytes = address - run.address
        if not nbytes:
            return
        check("cuMemSetAccess", d.cuMemSetAccess(run.address, nbytes, self._access, 1))
        if zero:
            check("cuMemsetD8Async", d.cuMemsetD8Async(run.address, 0, nbytes, _LEGACY_DEFAULT_STREAM))

    def _rollback(self, mapped: list[int], page_bytes: int) -> None:
        """Undo a failed :meth:`map_runs`: wait for queued zero-fills, then unmap page by page.

        Errors here are logged, not raised, so the caller sees the original failure.
        """
        if not mapped:
            return
        d = self._driver
        try:
            check("cuStreamSynchronize", d.cuStreamSynchronize(_LEGACY_DEFAULT_STREAM))
        except Exception as exc:
            log.warning("kvelastic: synchronising before rollback failed: %s", exc)
        for address in mapped:
            try:
                check("cuMemUnmap", d.cuMemUnmap(address, page_bytes))
            except Exception as exc:
                log.warning("kvelastic: rollback could not unmap page at %#x: %s", address, exc)

    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap ``[address, address + nbytes)``: one ranged call when the driver takes it.

        Whether ``cuMemUnmap`` accepts a range spanning several mappings is
        learned on the first multi-page call and remembered; when it does not,
        each page is unmapped on its own.
        """
        self._bind()
        page = self.page_bytes
        multi = page is not None and nbytes > page
        if not multi or self._ranged_unmap:
            check("cuMemUnmap", self._driver.cuMemUnmap(address, nbytes))
            return
        if self._ranged_unmap is False:
            self._unmap_pages(address, nbytes, page)
            return
        try:
            check("cuMemUnmap", self._driver.cuMemUnmap(address, nbytes))
        except DriverError as exc:
            self._unmap_pages(address, nbytes, page)  # raises if the range itself is bad
            self._ranged_unmap = False
            log.info("kvelastic: cuMemUnmap refused a multi-page range (%s); unmapping per page", exc.code)
            return
        self._ranged_unmap = True

    def _unmap_pages(self, address: int, nbytes: int, page: int) -> None:
        """One ``cuMemUnmap`` per page of a page-aligned range."""
        if nbytes % page:
            raise PoolError(f"unmap of {nbytes} bytes at {address:#x} is not a whole number of {page}-byte pages")
        unmap = self._driver.cuMemUnmap
        for offset in range(0, nbytes, page):
            check("cuMemUnmap", unmap(address + offset, page))

    # -- torch -----------------------------------------------------------------------------

    def tensor_view(self, address: int, nbytes: int, owner: object) -> "torch.Tensor":
        """A zero-copy flat int8 tensor over the range that keeps ``owner`` alive."""
        import torch

        self._bind()
        device = torch.device("cuda", self.device)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.int8, device=device)
        return torch.as_tensor(_DeviceBytes(address, nbytes, owner), device=device)

    def record_fence(self) -> Fence:
        """An event after all work queued so far on the device.

        It is recorded on the legacy default stream, which waits for all work
        already queued on every blocking stream: vLLM's compute stream and its
        side streams are covered whichever of them last touched a page.
        Non-blocking streams (our own copy streams) must be fenced by their owner.
        """
        self._bind()
        d = self._driver
        try:
            event = self._events.pop()
        except IndexError:
            flags = int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            event = check("cuEventCreate", d.cuEventCreate(flags))
        try:
            check("cuEventRecord", d.cuEventRecord(event, _LEGACY_DEFAULT_STREAM))
        except BaseException:
            self._recycle_event(event)
            raise
        return _EventFence(self, event)

    def _recycle_event(self, event: Any) -> None:
        """Keep an idle event for the next fence, or destroy it when closed or over the cap."""
        if not self._closed and len(self._events) < _MAX_POOLED_EVENTS:
            self._events.append(event)
            return
        self._binder.bind()
        self._driver.cuEventDestroy(event)

    # -- device-wide -----------------------------------------------------------------------

    def device_free_bytes(self) -> int | None:
        self._bind()
        free, _total = check("cuMemGetInfo", self._driver.cuMemGetInfo())
        return int(free)

    def _free_bytes_or_zero(self) -> int:
        """Free bytes for an error message; never raises."""
        try:
            return int(self._driver.cuMemGetInfo()[1])
        except Exception:
            return 0

    def synchronize(self) -> None:
        self._bind()
        check("cuCtxSynchronize", self._driver.cuCtxSynchronize())

    def close(self) -> None:
        """Destroy the idle events, then drop the primary context reference."""
        if self._closed:
            return
        self._binder.bind()
        self._closed = True
        d = self._driver
        try:
            while self._events:
                check("cuEventDestroy", d.cuEventDestroy(self._events.pop()))
        finally:
            cuda_driver.release_primary_context(self._cu_device)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"granularity={self._granularity}"
        return f"CudaBackend(device={self.device}, {state})"
