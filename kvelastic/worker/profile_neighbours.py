"""A starting engine's memory profile, as if its kvelastic neighbours on the GPU had stood still.

vLLM measures the device's free memory as a worker starts (``init_snapshot``,
taken in ``init_device``) and again after its profiling run, loads the weights
in between, and counts the difference as the engine's own memory. It asserts
that free memory did not rise ("Error in memory profiling ... other processes
... release GPU memory"). Neighbours that kvelastic serves on the same GPU map
and unmap KV pages as their load moves, so one that gave back more than the new
engine took in that window stopped its start, and one that grew was counted as
the new engine's own memory: its KV cap came out smaller by as much, for its
whole life.

Their physical KV bytes are in the GPU's shared account. Read after
``init_device`` and again just before vLLM profiles, the change is taken out of
a copy of the start snapshot (free memory, device memory and non-torch memory
alike), which vLLM reads for the profile in place of its own, put back after.
What neighbours change during the profiling run itself (seconds, against the
minutes of a model load) is not corrected, nor is any process kvelastic does
not serve. A read waits at most
:data:`READ_DEADLINE_S` for the account's lock; an account that is busy, absent
or unreadable means no correction, as before.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

from kvelastic.cluster.account import SharedAccount
from kvelastic.cluster.errors import ClusterError
from kvelastic.cluster.storage import account_path
from kvelastic.shared.errors import SharedFileError

log = logging.getLogger("vllm.kvelastic")

READ_DEADLINE_S = 0.02
#: The fields of vLLM's ``MemorySnapshot`` that count other processes' memory: free memory rises by what
#: the neighbours give back, device and non-torch memory fall by it.
RISES, FALLS = ("free_memory",), ("cuda_memory", "non_torch_memory")


def neighbours_bytes(gpu_id: str, shared_dir: str | Path | None) -> int | None:
    """The physical KV bytes the live members of ``gpu_id``'s shared account hold; None where it cannot tell."""
    try:
        account = SharedAccount.attach(account_path(gpu_id, shared_dir), lock_timeout_s=READ_DEADLINE_S)
    except (ClusterError, SharedFileError, OSError):  # no account (no neighbour), busy, or unreadable
        return None
    try:
        return sum(member.mapped_bytes for member in account.members())
    except (ClusterError, SharedFileError, OSError):
        return None
    finally:
        account.close()


class NeighbourCorrection:
    """The neighbours' bytes when the start snapshot was taken, and that snapshot corrected by their change."""

    def __init__(self, read: Callable[[], int | None]):
        """``read``: the neighbours' bytes now (:func:`neighbours_bytes` for this device), or None."""
        self.read = read
        self.at_start: int | None = None

    def snapshot_taken(self) -> None:
        """vLLM took its start snapshot (``init_device`` returned): note the neighbours' bytes."""
        self.at_start = self.read()

    def corrected(self, snapshot: Any) -> Any | None:
        """A copy of ``snapshot`` (vLLM's start ``MemorySnapshot``, a dataclass) as if the neighbours still
        held what they held when it was taken; None where nothing changed or either reading is missing."""
        if self.at_start is None or (now := self.read()) is None:
            return None
        released = self.at_start - now
        if not released:
            return None
        log.info("kvelastic: the other engines on this GPU %s %d MiB while this one loaded; vLLM's profile "
                 "counts them as they were", "gave back" if released > 0 else "took", abs(released) >> 20)
        moved = {name: getattr(snapshot, name) + released for name in RISES}
        moved.update({name: getattr(snapshot, name) - released for name in FALLS})
        return dataclasses.replace(snapshot, auto_measure=False, **moved)  # measured already: never again


def neighbours_on_this_device(shared_dir: str | Path | None) -> int | None:
    """:func:`neighbours_bytes` of this process's current CUDA device."""
    from kvelastic.cluster.device import current_cuda_identity

    try:
        gpu_id, _ = current_cuda_identity()
    except (RuntimeError, AssertionError):  # no CUDA device here: nothing to correct
        return None
    return neighbours_bytes(gpu_id, shared_dir)
