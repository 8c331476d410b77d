"""The page pool's lock, with the waits to take it counted: how many, how long, and who waited longest.

The upkeep thread grows the warm reserve a page group at a time with the pool's lock held, and a map
the scheduler waits for, or a step's call into the pool, needs the same lock. On an H200 (session 24)
the request right after an idle engine's 16k-token reload took 15-40 ms longer in a third of the reps
while the reserve regrew. Off vLLM (``scripts/bench_grow_beside.py``) the growth cost the GPU's compute
1-2 ms and a step's calls into the pool 4-6 ms, neither enough to explain it. These counts, in the
engine's log line and metrics, show whether the engine's threads wait for the lock there.

Taking the lock uncontended costs one non-blocking attempt; only a thread that must wait reads the clock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

#: Shorter waits are not counted: a page group's driver calls take about a millisecond on an idle host.
MIN_WAIT_S = 0.001


@dataclass(frozen=True)
class LockWaits:
    """Waits of at least :data:`MIN_WAIT_S` since the lock was made."""

    count: int
    seconds: float
    longest_s: float
    longest_by: str  # the name of the thread that waited longest ("" before any wait)


class CountedLock:
    """A re-entrant lock (``with`` it) that counts the waits of :data:`MIN_WAIT_S` or more to take it.

    The counts change only with the lock held, so writers never race; :meth:`waits` reads them without
    it (a report a wait behind is harmless, and a reader must not queue for the lock it reports on).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._lock = threading.RLock()
        self._clock = clock
        self._count = 0
        self._seconds = 0.0
        self._longest_s = 0.0
        self._longest_by = ""

    def __enter__(self) -> "CountedLock":
        if self._lock.acquire(blocking=False):
            return self
        start = self._clock()
        self._lock.acquire()
        waited = self._clock() - start
        if waited >= MIN_WAIT_S:
            self._count += 1
            self._seconds += waited
            if waited > self._longest_s:
                self._longest_s = waited
                self._longest_by = threading.current_thread().name
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def waits(self) -> LockWaits:
        return LockWaits(self._count, self._seconds, self._longest_s, self._longest_by)
