"""Is the process that wrote a member record still the one running under its pid?

A pid alone is not enough: pids are reused, and a process killed with SIGKILL
stays a zombie until its parent reaps it, although its GPU memory is already
gone. So a record carries the process start time (field 22 of
``/proc/<pid>/stat``, in clock ticks since boot), and a member is alive only
while a non-zombie process with that pid and that start time exists.

Pids are only comparable inside one pid namespace: processes that share
``/dev/shm`` but not a pid namespace would see each other as dead.
"""

from __future__ import annotations

import os

_DEAD_STATES = {"Z", "X", "x"}


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (state first), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode("ascii", errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = text[text.rfind(")") + 2:].split()
    return rest if len(rest) >= 20 else None


def _read_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of ``pid``, or None if there is no such process."""
    rest = _stat_fields(pid)
    return (rest[0], int(rest[19])) if rest else None


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs; zombies (which no one may reap) do not count."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            rest = _stat_fields(entry)
            if rest and rest[0] not in _DEAD_STATES and rest[2] == str(pgid):
                return True
    return False


def process_start_time(pid: int | None = None) -> int:
    """Start time of ``pid`` (default: this process) in clock ticks since boot; 0 without /proc."""
    stat = _read_stat(os.getpid() if pid is None else pid)
    return stat[1] if stat else 0


_own: tuple[int, int] = (0, 0)


def own_start_time() -> int:
    """This process's start time, read once per process (a forked child reads its own)."""
    global _own
    if _own[0] != os.getpid():
        _own = (os.getpid(), process_start_time())
    return _own[1]


def is_alive(pid: int, start_time: int) -> bool:
    """True while the process ``pid`` that started at ``start_time`` runs (zombies are dead)."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        stat = _read_stat(pid)
        if stat is None:
            return False
        state, started = stat
        return state not in _DEAD_STATES and (start_time == 0 or started == start_time)
    try:  # no /proc (not Linux): the pid alone is the best evidence there is
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
