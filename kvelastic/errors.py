"""Typed exceptions raised by kvelastic.

Every failure a caller may want to handle has its own class, so the vLLM
integration can turn "no physical memory" into a scheduling miss while a
misconfiguration stops start-up with a precise message.
"""

from __future__ import annotations


class KvelasticError(Exception):
    """Base class of every exception kvelastic raises on purpose."""


class ConfigError(KvelasticError, ValueError):
    """A ``KVELASTIC_*`` setting has a value kvelastic cannot accept."""


class PoolError(KvelasticError):
    """The page pool was used in a way its contract forbids."""


class PoolClosedError(PoolError):
    """The pool (or a region of it) was used after ``close()``."""


class PoolExhausted(KvelasticError):
    """No physical page could be had; callers turn this into a scheduling miss."""

    def __init__(self, message: str, *, requested_bytes: int = 0, available_bytes: int = 0):
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.available_bytes = available_bytes


class PoolLimitExceeded(PoolExhausted):
    """Mapping more would take the pool past its physical-byte limit."""


class DeviceOutOfMemory(PoolExhausted):
    """The device (or host) refused to create another physical page."""


class BackendUnavailable(KvelasticError):
    """The requested memory backend cannot run here (no CUDA, no driver, no memfd)."""


class DriverError(KvelasticError):
    """A CUDA driver call failed for a reason other than running out of memory."""

    def __init__(self, call: str, code: object, detail: str = ""):
        text = f"{call} failed: {code}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)
        self.call = call
        self.code = code


class LayoutError(KvelasticError):
    """vLLM's KV tensors have a layout kvelastic cannot map page by page."""


class PatchError(KvelasticError):
    """vLLM cannot be patched: unsupported version or a target that moved."""


class EngineCoreUnknown(PatchError):
    """A worker rank cannot tell which engine core drives it (an executor whose engine core said nothing):
    the rank stops rather than serve a KV cache that no scheduler maps."""


class ConnectorUnsupported(KvelasticError):
    """vLLM's KV connector reaches the KV cache in a way the elastic pool cannot serve (refused at start-up)."""


class UnsupportedOperation(KvelasticError, RuntimeError):
    """A vLLM operation that would do something other than it says while kvelastic backs the KV cache."""
