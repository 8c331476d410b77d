"""Tests of CudaBackend on its own (no pool): the driver semantics the pool relies on.

The GPU tests are skipped where torch sees no CUDA device. The tests of the
"no CUDA" paths and of the checked-call helper fake what they need and run
everywhere, so a CPU-only CI still covers them.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from kvelastic.errors import BackendUnavailable, DeviceOutOfMemory, DriverError
from kvelastic.pool import cuda_driver
from kvelastic.pool.backend import MapRun
from kvelastic.pool.cuda import CudaBackend

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


# ---------------------------------------------------------------- runs everywhere


def _pretend_torch_has_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let construction get past torch's checks so the driver-side failures can be reached."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_unavailable_when_torch_has_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable, match=r"torch\.cuda\.is_available\(\) is False"):
        CudaBackend()


def test_unavailable_when_cuda_bindings_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_torch_has_cuda(monkeypatch)
    monkeypatch.setattr(cuda_driver, "_driver", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import raise ImportError
    with pytest.raises(BackendUnavailable, match="cuda-python"):
        CudaBackend()


def test_unavailable_when_driver_library_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoDriver:
        @staticmethod
        def cuInit(flags: int) -> tuple:
            raise RuntimeError("libcuda.so.1: cannot open shared object file")

    _pretend_torch_has_cuda(monkeypatch)
    monkeypatch.setattr(cuda_driver, "_driver", NoDriver)
    with pytest.raises(BackendUnavailable, match="cannot be loaded.*libcuda"):
        CudaBackend()


def test_unavailable_when_cuinit_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoDevice:
        @staticmethod
        def cuInit(flags: int) -> tuple:
            return (100,)  # CUDA_ERROR_NO_DEVICE

    _pretend_torch_has_cuda(monkeypatch)
    monkeypatch.setattr(cuda_driver, "_driver", NoDevice)
    with pytest.raises(BackendUnavailable, match="cuInit failed"):
        CudaBackend()


def test_check_unpacks_results_and_types_errors() -> None:
    driver = pytest.importorskip("cuda.bindings.driver")
    ok = driver.CUresult.CUDA_SUCCESS
    assert cuda_driver.check("cuX", (ok,)) is None
    assert cuda_driver.check("cuX", (ok, 7)) == 7
    assert cuda_driver.check("cuX", (ok, 7, 8)) == (7, 8)
    with pytest.raises(DeviceOutOfMemory, match="cuMemCreate.*CUDA_ERROR_OUT_OF_MEMORY") as oom:
        cuda_driver.check("cuMemCreate", (driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY,), requested_bytes=4096)
    assert oom.value.requested_bytes == 4096
    with pytest.raises(DriverError, match="cuMemMap.*CUDA_ERROR_INVALID_VALUE") as bad:
        cuda_driver.check("cuMemMap", (driver.CUresult.CUDA_ERROR_INVALID_VALUE,))
    assert bad.value.call == "cuMemMap"
    assert bad.value.code == "CUDA_ERROR_INVALID_VALUE"


def test_importing_the_backend_does_not_import_cuda_bindings() -> None:
    code = "import sys, kvelastic.pool.cuda; sys.exit('cuda.bindings' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---------------------------------------------------------------- GPU only


@pytest.fixture
def backend():
    b = CudaBackend()
    yield b
    b.synchronize()
    b.close()


class _Owner:
    """Something weak-referenceable to prove a view keeps its owner alive."""


def _mapped(backend: CudaBackend, npages: int, *, zero: bool = True) -> tuple[int, list[int], int]:
    """Reserve, create and map ``npages`` granularity pages as one run: (address, handles, page)."""
    page = backend.granularity
    address = backend.reserve_address(npages * page)
    handles = [backend.create_page(page) for _ in range(npages)]
    backend.map_runs([MapRun(address, tuple(handles))], page, zero=zero)
    return address, handles, page


def _teardown(backend: CudaBackend, address: int, handles: list[int], page: int, reserved_pages: int) -> None:
    backend.synchronize()
    backend.unmap(address, len(handles) * page)
    for handle in handles:
        backend.release_page(handle)
    backend.free_address(address, reserved_pages * page)


@gpu
@needs_gpu
class TestCudaBackendOnGpu:
    def test_granularity_and_reservation_alignment(self, backend: CudaBackend) -> None:
        g = backend.granularity
        assert g > 0 and g & (g - 1) == 0
        address = backend.reserve_address(8 * g)
        assert address % g == 0
        backend.free_address(address, 8 * g)

    def test_write_through_view_and_read_back(self, backend: CudaBackend) -> None:
        address, handles, page = _mapped(backend, 4)
        owner = _Owner()
        alive = weakref.ref(owner)
        view = backend.tensor_view(address, 4 * page, owner)
        del owner
        assert view.dtype == torch.int8 and view.numel() == 4 * page
        assert view.device == torch.device("cuda", backend.device)
        assert view.data_ptr() == address  # zero-copy
        assert int(view.count_nonzero()) == 0  # mapped with zero=True
        pattern = (torch.arange(4 * page, device=view.device) % 127).to(torch.int8)
        view.copy_(pattern)
        assert torch.equal(view.cpu(), pattern.cpu())
        assert alive() is not None, "the view must keep its owner alive"
        del view
        gc.collect()
        assert alive() is None, "dropping the view must release its owner"
        _teardown(backend, address, handles, page, 4)

    def test_reused_handle_maps_as_zeros(self, backend: CudaBackend) -> None:
        page = backend.granularity
        address = backend.reserve_address(2 * page)
        handle = backend.create_page(page)
        backend.map_runs([MapRun(address, (handle,))], page, zero=True)
        backend.tensor_view(address, page, None).fill_(0x7F)
        backend.record_fence().wait()
        backend.unmap(address, page)
        second = address + page
        # Without zeroing the old bytes show through: proves the check below means something.
        backend.map_runs([MapRun(second, (handle,))], page, zero=False)
        assert bool((backend.tensor_view(second, page, None) == 0x7F).all())
        backend.synchronize()
        backend.unmap(second, page)
        backend.map_runs([MapRun(second, (handle,))], page, zero=True)
        assert int(backend.tensor_view(second, page, None).count_nonzero()) == 0
        backend.synchronize()
        backend.unmap(second, page)
        backend.release_page(handle)
        backend.free_address(address, 2 * page)

    def test_device_memory_follows_created_pages(self, backend: CudaBackend) -> None:
        npages = 16
        page = backend.granularity
        # One full cycle first, so that any one-time driver bookkeeping for VMM (allocated
        # lazily on first use) is already paid and the deltas below are the pages alone.
        warm_address, warm_handles, _ = _mapped(backend, 1)
        _teardown(backend, warm_address, warm_handles, page, 1)
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        handles = [backend.create_page(page) for _ in range(npages)]
        free_created = torch.cuda.mem_get_info()[0]
        # Exact: cuMemCreate commits whole granularity pages and nothing else should allocate
        # here. If the driver ever charges page-table memory, this is where it would show.
        assert free_before - free_created == npages * page
        address = backend.reserve_address(npages * page)
        backend.map_runs([MapRun(address, tuple(handles))], page, zero=True)
        assert torch.cuda.mem_get_info()[0] == free_created, "mapping must not commit more memory"
        assert backend.device_free_bytes() == torch.cuda.mem_get_info()[0]
        backend.unmap(address, npages * page)
        assert torch.cuda.mem_get_info()[0] == free_created, "unmapped pages stay committed until released"
        for handle in handles:
            backend.release_page(handle)
        backend.free_address(address, npages * page)
        assert torch.cuda.mem_get_info()[0] == free_before

    def test_fence_is_done_after_synchronize(self, backend: CudaBackend) -> None:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            a = a @ a / 64
        fence = backend.record_fence()
        backend.synchronize()
        assert fence.is_done()
        fence.wait()
        fences = [backend.record_fence() for _ in range(300)]  # more than the idle-event cap
        fences[-1].wait()
        assert all(f.is_done() for f in fences)
        del fences
        gc.collect()
        recycled = backend.record_fence()  # built on an event an earlier fence gave back
        recycled.wait()
        assert recycled.is_done()

    def test_unmap_of_a_multi_page_range(self, backend: CudaBackend) -> None:
        npages = 16
        page = backend.granularity
        address = backend.reserve_address(npages * page)
        handles = [backend.create_page(page) for _ in range(npages)]
        half = npages // 2
        runs = [MapRun(address, tuple(handles[:half])), MapRun(address + half * page, tuple(handles[half:]))]
        backend.map_runs(runs, page, zero=True)
        backend.unmap(address, npages * page)
        print(f"cuMemUnmap over {npages} mappings in one call: {backend._ranged_unmap}")
        assert backend._ranged_unmap is not None
        # Everything really is unmapped: the same addresses take new mappings.
        backend.map_runs([MapRun(address, tuple(reversed(handles)))], page, zero=True)
        assert int(backend.tensor_view(address, npages * page, None).count_nonzero()) == 0
        _teardown(backend, address, handles, page, npages)

    def test_failed_map_runs_unmaps_what_it_mapped(self, backend: CudaBackend) -> None:
        page = backend.granularity
        address = backend.reserve_address(4 * page)
        handles = [backend.create_page(page) for _ in range(4)]
        other = backend.reserve_address(page)
        backend.free_address(other, page)  # an address in no reservation: mapping there fails
        runs = [MapRun(address, tuple(handles[:3])), MapRun(other, (handles[3],))]
        with pytest.raises(DriverError):
            backend.map_runs(runs, page, zero=True)
        backend.map_runs([MapRun(address, tuple(handles))], page, zero=True)  # fails if anything stayed mapped
        _teardown(backend, address, handles, page, 4)

    def test_out_of_memory_is_typed(self, backend: CudaBackend) -> None:
        total = torch.cuda.mem_get_info()[1]
        g = backend.granularity
        too_much = -(-2 * total // g) * g
        with pytest.raises(DeviceOutOfMemory) as excinfo:
            backend.create_page(too_much)
        assert excinfo.value.requested_bytes == too_much
        handle = backend.create_page(g)  # the device still works afterwards
        backend.release_page(handle)

    def test_calls_from_a_fresh_thread(self, backend: CudaBackend) -> None:
        errors: list[BaseException] = []

        def work() -> None:
            try:
                address, handles, page = _mapped(backend, 2, zero=True)
                backend.record_fence().wait()
                _teardown(backend, address, handles, page, 2)
            except BaseException as exc:  # reported in the main thread
                errors.append(exc)

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        assert not errors, errors

    def test_closed_backend_refuses_work(self) -> None:
        from kvelastic.errors import PoolClosedError

        b = CudaBackend()
        b.close()
        b.close()  # idempotent
        with pytest.raises(PoolClosedError):
            b.reserve_address(b.granularity)
