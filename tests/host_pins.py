"""A spawned rank's host-tier share, pinned chunk by chunk when the test says so.

The rank's real :class:`~kvelastic.offload.host_memory.HostMemory` (its pin
thread, its watchers, the rank's reports) runs as in an engine; only the
driver's page locking (``cuMemHostRegister``, a GPU host's boundary) is stood
in for by a gate the test opens one chunk at a time. Installed in the rank's
process before ``start_rank`` builds the share.
"""

from __future__ import annotations

import threading
import time

from kvelastic.offload.host_memory import HostMemory, PinError

CHUNK_SLOTS = 4  # a background chunk's slots; the head chunk (pinned at construction) is one slot
GATE_TIMEOUT_S = 120.0


class GatePinner:
    """The head chunk pins at once; each later chunk waits for a permit (one thread: chunks pin in order)."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)
        self._head = True

    def pin(self, address: int, nbytes: int) -> None:
        if self._head:
            self._head = False
            return
        if not self._permits.acquire(timeout=GATE_TIMEOUT_S):
            raise PinError("the test never let this chunk pin")

    def unpin(self, address: int) -> None:
        return None

    def release(self, chunks: int) -> None:
        if chunks > 0:
            self._permits.release(chunks)


class GatedHostShare:
    """Makes ``start_rank``'s host share a gated :class:`HostMemory`; :meth:`pin` lets chunks through."""

    def __init__(self) -> None:
        from kvelastic.offload import host_tier

        self.pinner = GatePinner()
        self.memory: HostMemory | None = None
        self._seen: list[tuple[int, bool]] = []
        self._watching = False

        def allocate_slots(slots: int, slot_bytes: int, *, pin: bool, deferred: bool = False) -> HostMemory:
            self.memory = HostMemory(slots, slot_bytes, pinner=self.pinner, chunk_bytes=CHUNK_SLOTS * slot_bytes,
                                     head_bytes=slot_bytes, threads=1, hugepages=False, deferred=deferred)
            return self.memory

        host_tier.allocate_slots = allocate_slots  # this rank process only: _host_share looks it up per call

    @staticmethod
    def cpu_bytes(cache, slots: int, world: int) -> int:
        """``KVELASTIC_CPU_BYTES`` that gives each of ``world`` ranks ``slots`` slots."""
        from kvelastic.hooks.offload_setup import BlockRows

        return slots * world * BlockRows(cache).slot_bytes

    def pin(self, chunks: int, slots: int) -> tuple[int, bool]:
        """Let ``chunks`` more chunks pin; return (ready, settled) once at least ``slots`` are ready (or settled).

        Watches after ``start_rank`` did, so the rank's own watcher (its reports) has every value seen here."""
        assert self.memory is not None, "the rank built no host share"
        if not self._watching:
            self._watching = True
            self.memory.watch(lambda ready, settled: self._seen.append((ready, settled)))
        self.pinner.release(chunks)
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not (self._seen[-1][0] >= slots or self._seen[-1][1]):
            assert time.monotonic() < deadline, f"the rank never pinned {slots} slots: {self._seen[-1]}"
            time.sleep(0.01)
        return self._seen[-1]

    def open(self) -> None:
        """Let every chunk left pin (at the rank's exit: no pin thread waits on the gate)."""
        self.pinner.release(1 << 16)
