"""The page pool's lock, with the waits to take it counted, and the long holds and waits named.

The upkeep thread grows the warm reserve a page group at a time with the pool's lock held, and a map
the scheduler waits for, or a step's call into the pool, needs the same lock. The counts tell who
waits and how long (on an H200, beside an idle engine's 16k-token reload, the engine's threads waited
16-52 ms a rep for the lock while the reserve regrew, 3-13 without it); the lock also names its recent
long holds (which thread, in which of the pool's methods) and, for each long wait, who held the lock
when it began.

The long holds are the upkeep thread's, growing and trimming the reserve (there 6-20 ms a page group,
20-31 ms a trim) while the mapper waits. So a long holder can also step aside: :meth:`CountedLock.others_waiting`
tells it, between two batches of pages, that another thread waits, and :meth:`CountedLock.let_waiters_in` lets
that thread go first before it takes the lock again.

Taking the lock uncontended costs one non-blocking attempt and two clock reads for the hold.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

#: Shorter waits are not counted: a page group's driver calls take about a millisecond on an idle host.
MIN_WAIT_S = 0.001
#: Holds and waits at least this long are kept by name among the :data:`RECENT` latest.
LONG_S = 0.005
RECENT = 16
#: A holder steps aside only once it held the lock this long, so that work done in turns still moves
#: while another thread calls into the pool again and again (a waiter waits this, or one page, at most).
MIN_TURN_S = 0.002
#: How long a holder that stepped aside waits for the waiters to take the lock before it takes it again.
STEP_ASIDE_S = 0.05


@dataclass(frozen=True)
class LongEvent:
    """A hold of the lock, or a wait for it, of :data:`LONG_S` or more."""

    at: float  # the lock's clock when it ended
    seconds: float
    who: str  # "thread in method" for a hold; the waiting thread's name for a wait
    behind: str = ""  # a wait's holder when it began ("thread in method")


@dataclass(frozen=True)
class LockWaits:
    """Waits of at least :data:`MIN_WAIT_S` since the lock was made, and the latest long holds and waits."""

    count: int
    seconds: float
    longest_s: float
    longest_by: str  # the name of the thread that waited longest ("" before any wait)
    long_holds: tuple[LongEvent, ...] = ()
    long_waits: tuple[LongEvent, ...] = ()


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
        self._depth = 0  # the owner's nesting: only the owner changes it
        self._held_since = 0.0
        self._holder = ""
        self._long_holds: deque[LongEvent] = deque(maxlen=RECENT)
        self._long_waits: deque[LongEvent] = deque(maxlen=RECENT)
        self._waiters: set[int] = set()  # threads blocked taking the lock (set.add/discard hold the GIL)

    def __enter__(self) -> "CountedLock":
        if not self._lock.acquire(blocking=False):
            self._wait()
        self._depth += 1
        if self._depth == 1:
            self._held_since = self._clock()
            self._holder = f"{threading.current_thread().name} in {sys._getframe(1).f_code.co_name}"
        return self

    def _wait(self) -> None:
        behind = self._holder  # who holds it now (read racily: it names the holder of this moment)
        me = threading.get_ident()
        start = self._clock()
        self._waiters.add(me)
        try:
            self._lock.acquire()
        finally:
            self._waiters.discard(me)
        end = self._clock()
        waited = end - start
        if waited < MIN_WAIT_S:
            return
        name = threading.current_thread().name
        self._count += 1
        self._seconds += waited
        if waited > self._longest_s:
            self._longest_s, self._longest_by = waited, name
        if waited >= LONG_S:
            self._long_waits.append(LongEvent(end, waited, name, behind))

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            end = self._clock()
            held = end - self._held_since
            if held >= LONG_S:
                self._long_holds.append(LongEvent(end, held, self._holder))
            self._holder = ""
        self._lock.release()

    def others_waiting(self) -> bool:
        """Another thread waits for the lock, and the caller, holding it once for :data:`MIN_TURN_S` or
        more, should let it in now."""
        return (bool(self._waiters) and self._depth == 1
                and self._clock() - self._held_since >= MIN_TURN_S)

    def let_waiters_in(self, patience_s: float = STEP_ASIDE_S) -> None:
        """Called without the lock: return once the threads waiting for it have taken it (or after
        ``patience_s``), so that the caller's next ``with`` queues behind them instead of winning the race."""
        deadline = time.monotonic() + patience_s
        while self._waiters and time.monotonic() < deadline:
            time.sleep(0.0002)

    def waits(self) -> LockWaits:
        return LockWaits(self._count, self._seconds, self._longest_s, self._longest_by,
                         tuple(self._long_holds), tuple(self._long_waits))
