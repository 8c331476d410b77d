"""Typed exceptions of the shared-file layer (``kvelastic.shared``)."""

from __future__ import annotations

from kvelastic.errors import KvelasticError


class SharedFileError(KvelasticError):
    """A shared file or directory could not be used safely."""


class UnsafeSharedPath(SharedFileError):
    """A path is a symlink, not what it should be (a FIFO, a directory), or belongs to an untrusted owner."""


class BadSharedData(SharedFileError, ValueError):
    """A shared file is too large, or its content is not the bounded format kvelastic writes."""


class LockBusy(SharedFileError):
    """Another process held a lock past the deadline this caller may wait."""


class NoSpace(SharedFileError):
    """The shared directory's file system is full (``/dev/shm`` is 64 MiB in a default Docker container)."""
