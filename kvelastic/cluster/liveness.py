"""Is the process that wrote a member record still the one running under its pid?

A pid alone is not enough: pids are reused, and a process killed with SIGKILL
stays a zombie until its parent reaps it, although its GPU memory is already
gone. So a record carries the process start time (field 22 of
``/proc/<pid>/stat``, in clock ticks since boot), and a member is alive only
while a non-zombie process with that pid and that start time exists.

Pids are only comparable inside one pid namespace: processes that share
``/dev/shm`` but not a pid namespace (two containers) would see each other as
dead. Records and file names therefore carry the pid namespace too (the inode
of ``/proc/self/ns/pid``), and :func:`provably_dead` says yes only for a
process of this namespace that is gone: one of another namespace, or one whose
``/proc`` entry is hidden, is never declared dead.
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


_own_ns: tuple[int, int] = (0, 0)


def own_pid_namespace() -> int:
    """The inode of this process's pid namespace, read once per process (0 where ``/proc`` does not tell)."""
    global _own_ns
    if _own_ns[0] != os.getpid():
        try:
            inode = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            inode = 0
        _own_ns = (os.getpid(), inode)
    return _own_ns[1]


def provably_dead(pid_ns: int, pid: int, start_time: int) -> bool:
    """True only for a process of this pid namespace that is gone (or a zombie, or its pid reused).

    A process of another namespace cannot be looked up from here, so it counts
    as alive; a pid that ``/proc`` does not show but that still exists (a
    ``hidepid`` mount) counts as alive too.
    """
    if pid_ns != own_pid_namespace() or pid <= 0:
        return False
    if is_alive(pid, start_time):
        return False
    if _stat_fields(pid) is not None:
        return True  # listed in /proc: a zombie, or the pid now belongs to another process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False  # it exists but /proc hides it (hidepid): its start time cannot be checked


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
