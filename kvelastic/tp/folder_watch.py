"""Whether the engine's folder may have changed since a rank last looked, from one ``lstat``.

A rank's idle thread looks for idle command files 50 times a second. The full
look (:func:`~kvelastic.tp.board.idle_files`: the scope from the environment, two
checked directory opens, a listing) took about 0.3 ms of CPU a tick on the CPU
model, holding the GIL the worker's own thread needs to launch its steps, and it
almost always finds nothing. A directory's mtime, ctime and size change whenever an
entry is created, renamed in or removed, which is all the scheduler does there, so an
unchanged ``lstat`` means nothing new, with two exceptions handled here:

* timestamps come from a coarse clock (a few ms), so a change in the same tick as the
  look that recorded them would keep them equal: a folder changed within
  :data:`QUIET_NS` of the wall clock is looked at again on every tick until it is older;
* a clock set back, or anything else this misses, waits at most :data:`RECHECK_S`: the
  full look runs that often whatever the ``lstat`` says.

The full look keeps its checks; this only decides when it is worth running. A step
that names idle commands (``idle_upto``) looks regardless.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

QUIET_NS = 50_000_000  # 50 ms: well over any file-system timestamp tick
RECHECK_S = 1.0


class FolderWatch:
    """Says when ``path`` may hold entries the last full look did not see."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns):
        self.path = path
        self._path = os.fspath(path)  # a str: no conversion on every tick
        self.clock = clock
        self.wall_ns = wall_ns
        self._seen: tuple[int, ...] | None = None  # the folder's lstat before the last look, if trusted
        self._next_look = 0.0

    def should_look(self) -> bool:
        """True if a full look is due; the caller then looks (the folder's state is taken before it, so a
        change during the look shows next time). A folder that cannot be read is always looked at."""
        try:
            st = os.stat(self._path, follow_symlinks=False)
        except OSError:
            self.forget()
            return True
        key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        now = self.clock()
        if key == self._seen and now < self._next_look:
            return False
        quiet = self.wall_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > QUIET_NS
        self._seen = key if quiet else None
        self._next_look = now + RECHECK_S
        return True

    def forget(self) -> None:
        """Look next time whatever the folder's state (the last look failed part-way)."""
        self._seen = None
