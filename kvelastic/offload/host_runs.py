"""How long the runs of host-tier hits are: the one being looked up now, and the longest of late.

A *run* is a sequence of consecutive prefix lookups that the host tier
served (``OffloadManager.load_on_miss``): vLLM looks a request's blocks up in
order, so one request's prefix on the host is one run, ended by a GPU hit, a
miss, or the step's end. Two decisions read it:

* whether a run is long enough to be loaded a page group at a time (the
  manager, on the scheduler's thread, reads :attr:`HostRuns.current`): a step
  of many short runs keeps one batched load, each piece costing launches;
* how much warm memory a reload would want (the warm reserve, on the upkeep
  thread, reads :meth:`HostRuns.longest`): the longest run loaded within the
  last ``window_s`` seconds, so that memory is held only for reloads that
  actually happen, and not past a minute of none.

The longest-of-late is a monotonic queue (each entry longer than every later
one), so it stays a few entries long whatever the rate of runs; a small lock
keeps the two threads' views whole.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

#: Seconds a run keeps counting toward :meth:`HostRuns.longest` after it was loaded.
RUN_WINDOW_S = 60.0


class HostRuns:
    """The current run of host hits (blocks), and the longest ones of the last ``window_s`` seconds."""

    def __init__(self, *, window_s: float = RUN_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self.current = 0  # blocks of the run being looked up now (scheduler thread only)
        self.ended = 0  # runs looked up to their end (scheduler thread only): each one request's prefix
        self._longest: deque[tuple[float, int]] = deque()  # (when it ended, blocks): blocks strictly falling
        self._lock = threading.Lock()

    def hit(self) -> None:
        """One more block of the current run was served by the host tier."""
        self.current += 1

    def end(self) -> None:
        """The current run ended (a GPU hit, a miss, the step's end); remember it if it had blocks."""
        blocks, self.current = self.current, 0
        if blocks:
            self.ended += 1
            self.record(blocks)

    def record(self, blocks: int) -> None:
        """A run of ``blocks`` was loaded whole (an asynchronous load plans a request's run at once)."""
        now = self._clock()
        with self._lock:
            entries = self._longest
            while entries and entries[-1][1] <= blocks:
                entries.pop()
            entries.append((now, blocks))
            self._expire(now)

    def longest(self, now: float | None = None) -> int:
        """Blocks of the longest run that ended within the window (0: none)."""
        now = self._clock() if now is None else now
        with self._lock:
            self._expire(now)
            return self._longest[0][1] if self._longest else 0

    def _expire(self, now: float) -> None:
        entries = self._longest
        while entries and entries[0][0] < now - self.window_s:
            entries.popleft()
