"""Checked calls into the CUDA driver API through cuda-python (``cuda.bindings``).

cuda-python returns ``(CUresult, *values)`` from every call instead of raising,
so each call site would otherwise repeat the same unpack-and-test. :func:`check`
does it once and turns failures into kvelastic's typed exceptions: running out
of memory becomes :class:`DeviceOutOfMemory` (a scheduling miss upstream), any
other code a :class:`DriverError` naming the call and the driver's error name.

``cuda.bindings`` is imported on first use, never when kvelastic is imported,
so CPU-only installs (and the host backend) work without cuda-python.

The driver API acts on the context current in the calling thread. kvelastic
works in the *primary* context of the torch device, the one the CUDA runtime
(and therefore torch) uses, so pointers, streams and events are shared with
torch without any translation.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from kvelastic.errors import BackendUnavailable, DeviceOutOfMemory, DriverError

_driver: ModuleType | None = None


def driver() -> ModuleType:
    """The ``cuda.bindings.driver`` module, imported on first use.

    Raises :class:`BackendUnavailable` when cuda-python is missing or broken, so
    the caller can fall back or stop with a precise message.
    """
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver as module
        except Exception as exc:  # ImportError, or a broken/partial install
            raise BackendUnavailable(
                "the CUDA backend needs cuda-python's low-level bindings "
                f"(`from cuda.bindings import driver` failed: {exc!r}); "
                "install cuda-python matching the CUDA driver"
            ) from exc
        _driver = module
    return _driver


def error_name(err: Any) -> str:
    """``CUDA_ERROR_...`` name of a driver result, without ever raising."""
    try:
        status, name = driver().cuGetErrorName(err)
        if int(status) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return str(getattr(err, "name", err))


def error_string(err: Any) -> str:
    """The driver's human description of a result ("out of memory"), or ''."""
    try:
        status, text = driver().cuGetErrorString(err)
        if int(status) == 0 and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        pass
    return ""


def raise_for(call: str, err: Any, *, requested_bytes: int = 0) -> None:
    """Raise the typed exception for a failed driver result ``err``."""
    name = error_name(err)
    detail = error_string(err)
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        text = f"{call} failed: {name}"
        if requested_bytes:
            text += f" (asked for {requested_bytes} bytes)"
        raise DeviceOutOfMemory(text, requested_bytes=requested_bytes)
    raise DriverError(call, name, detail)


def check(call: str, result: Any, *, requested_bytes: int = 0) -> Any:
    """Unpack a cuda-python result tuple, raising on any error.

    Returns None for calls that only give a status, the single value for calls
    that give one, and a tuple for calls that give several.
    """
    err = result[0]
    if int(err):  # CUresult is an int enum and CUDA_SUCCESS is 0
        raise_for(call, err, requested_bytes=requested_bytes)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return tuple(result[1:])


def torch_device_index(device: int | None) -> int:
    """Validate ``device`` against torch and initialise torch's CUDA state.

    torch must create the primary context first: retaining it ourselves before
    torch initialises would work, but torch's lazy init would then run inside
    a kvelastic call at an unpredictable moment. Raises
    :class:`BackendUnavailable` when torch cannot use CUDA.
    """
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "the CUDA backend needs a CUDA device, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "check the GPU, the NVIDIA driver and CUDA_VISIBLE_DEVICES, or use the host backend"
        )
    try:
        torch.cuda.init()
        index = torch.cuda.current_device() if device is None else int(device)
        count = torch.cuda.device_count()
    except Exception as exc:
        raise BackendUnavailable(f"torch could not initialise CUDA: {exc}") from exc
    if not 0 <= index < count:
        raise BackendUnavailable(f"CUDA device {index} does not exist (torch sees {count} device(s))")
    return index


def init_driver() -> None:
    """``cuInit(0)``, turning any failure (no driver library, no device) into BackendUnavailable."""
    try:
        result = driver().cuInit(0)
    except BackendUnavailable:
        raise
    except Exception as exc:  # cuda-python raises when libcuda.so cannot be loaded
        raise BackendUnavailable(f"the CUDA driver library cannot be loaded: {exc}") from exc
    if int(result[0]):
        raise BackendUnavailable(f"cuInit failed: {error_name(result[0])} ({error_string(result[0])})")


def retain_primary_context(device: int) -> tuple[Any, Any]:
    """``(CUdevice, CUcontext)`` of ``device``'s primary context, retained once.

    Balance with :func:`release_primary_context` so the context's reference
    count drops back when the backend closes.
    """
    d = driver()
    cu_device = check("cuDeviceGet", d.cuDeviceGet(device))
    context = check("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(cu_device))
    return cu_device, context


def release_primary_context(cu_device: Any) -> None:
    """Drop the reference taken by :func:`retain_primary_context`."""
    d = driver()
    check("cuDevicePrimaryCtxRelease", d.cuDevicePrimaryCtxRelease(cu_device))


def device_attribute(cu_device: Any, attribute_name: str) -> int:
    """Integer value of ``CUdevice_attribute.<attribute_name>`` for ``cu_device``."""
    d = driver()
    attribute = getattr(d.CUdevice_attribute, attribute_name)
    return int(check("cuDeviceGetAttribute", d.cuDeviceGetAttribute(attribute, cu_device)))


class ContextBinder:
    """Makes one context current in each thread that calls :meth:`bind`.

    ``cuCtxSetCurrent`` is needed once per thread (a new thread starts with no
    current context); after that the binding sticks, so a thread-local flag
    makes the per-call cost a dictionary lookup instead of a driver call.
    That holds because a kvelastic process drives one GPU: no thread of it
    makes another device's context current between two calls.
    """

    def __init__(self, context: Any):
        self.context = context
        self._local = threading.local()

    def bind(self) -> None:
        """Make the context current in the calling thread (cheap after the first time)."""
        if getattr(self._local, "bound", False):
            return
        check("cuCtxSetCurrent", driver().cuCtxSetCurrent(self.context))
        self._local.bound = True
