"""Locks with a deadline: a process that holds one too long costs its waiters a miss, never a stall.

``flock`` waits forever for a holder that never lets go (a stopped container,
a process under a debugger). Here the lock is tried without blocking and
retried with short, growing sleeps until the deadline; the caller turns a miss
into "not this time" (on the scheduler's path: no headroom this tick).
"""

from __future__ import annotations

import fcntl
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from kvelastic.shared.errors import LockBusy

FIRST_RETRY_S = 0.0002
LONGEST_SLEEP_S = 0.005


def flock_by(fd: int, deadline: float, *, exclusive: bool, what: str) -> None:
    """Take ``flock`` on ``fd`` before ``deadline`` (``time.monotonic()``), or raise LockBusy."""
    operation = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    pause = FIRST_RETRY_S
    while True:
        try:
            fcntl.flock(fd, operation)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockBusy(f"{what} stayed locked by another process past the deadline") from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, LONGEST_SLEEP_S)


@contextmanager
def locked(thread_lock: threading.Lock, fd: int, timeout_s: float, *, exclusive: bool,
           what: str) -> Iterator[None]:
    """Hold ``thread_lock`` and ``flock`` on ``fd``, both taken within ``timeout_s``; LockBusy otherwise.

    The thread lock keeps threads of one process apart (they share the open
    file description, hence its flock); it is waited for under the same deadline.
    """
    deadline = time.monotonic() + timeout_s
    if not thread_lock.acquire(timeout=max(0.0, timeout_s)):
        raise LockBusy(f"{what} stayed locked by another thread past the deadline")
    try:
        flock_by(fd, deadline, exclusive=exclusive, what=what)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        thread_lock.release()
