"""Where ranks and their scheduler meet: one folder in shared memory per engine.

The folder is named after the engine-core process (the workers' parent: its pid
namespace, pid and start time), so the scheduler and its ranks find each other
without any extra configuration, and a reused pid never finds an old engine's
files. It lives in the scope's checked folder (:mod:`kvelastic.shared.scope`:
this user's, mode 0700) and is itself checked every time it is opened. Each
rank writes two files there and nothing else:

* ``rank<r>.info``: what the scheduler needs to plan (the group layout, bytes
  per group, the physical limit vLLM profiled, host-tier slots), written once,
  as bounded JSON (:mod:`kvelastic.tp.rank_files`);
* ``rank<r>.board``: a small int64 array the rank keeps current: its pid, the
  last command and step it applied, free device bytes, how much of its host-tier
  share it has pinned (:mod:`kvelastic.tp.host_supply`), and per page group the
  number of the command that mapped it (negative: refused; 0: unmapped). It is
  created new (never through an existing path) with every block allocated at
  once, so a full ``/dev/shm`` is an error at start-up, not a SIGBUS later.

A single writer per file needs no lock; the scheduler only reads them.
Commands sent while the engine is idle are dropped into the folder as
``idle-<first>-<last>.cmd`` files, which the scheduler writes and removes.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from kvelastic.shared.errors import BadSharedData
from kvelastic.shared.files import SafeDir
from kvelastic.shared.names import Owner, engine_dir_name
from kvelastic.shared.scope import current_scope
from kvelastic.tp.protocol import Command
from kvelastic.tp.rank_files import (MAX_COMMANDS_BYTES, MAX_INFO_BYTES, RankInfo, decode_commands, decode_info,
                                     encode_commands, encode_info)

__all__ = ["RankInfo", "RankBoard", "engine_dir", "write_info", "read_info", "write_idle_commands",
           "idle_files", "read_idle_commands", "remove_rank_files"]

HEADER = 8
PID, APPLIED, STEPS_DONE, DEVICE_FREE, MAPPED_BYTES, HELD_BYTES, HOST_PINNED = range(7)
_IDLE = re.compile(r"^idle-(\d{1,18})-(\d{1,18})\.cmd$")


def engine_dir(engine_pid: int, root: str | os.PathLike | None = None) -> Path:
    """The engine's folder, named by its pid namespace, pid and start time: a reused pid never finds old files."""
    from kvelastic.cluster.liveness import own_pid_namespace, process_start_time

    owner = Owner(own_pid_namespace(), engine_pid, process_start_time(engine_pid))
    return current_scope(root).path / engine_dir_name(owner)


def open_folder(folder: Path, *, create: bool) -> SafeDir | None:
    """``folder`` and its parent, both checked (and created when ``create``); None if it does not exist."""
    scope = current_scope()
    parent = SafeDir.open(folder.parent, scope, create=create)
    if parent is None:
        return None
    with parent:
        return parent.subdir(folder.name, create=create)


def _folder(folder: Path) -> SafeDir:
    found = open_folder(folder, create=False)
    if found is None:
        raise FileNotFoundError(f"no engine folder {folder}")
    return found


def write_info(folder: Path, info: RankInfo) -> None:
    with open_folder(folder, create=True) as directory:  # type: ignore[union-attr]
        directory.write_atomic(f"rank{info.rank}.info", encode_info(info))


def read_info(folder: Path, rank: int) -> RankInfo | None:
    """Rank ``rank``'s description, or None while it has not written one; BadSharedData if malformed."""
    try:
        with _folder(folder) as directory:
            data = directory.read_bytes(f"rank{rank}.info", MAX_INFO_BYTES)
    except FileNotFoundError:
        return None
    info = decode_info(data, str(folder / f"rank{rank}.info"))
    if info.rank != rank:
        raise BadSharedData(f"{folder}/rank{rank}.info describes rank {info.rank}")
    return info


def remove_rank_files(folder: Path, rank: int) -> None:
    """Remove what rank ``rank`` wrote (its own files only)."""
    try:
        with _folder(folder) as directory:
            for name in (f"rank{rank}.board", f"rank{rank}.info"):
                directory.unlink_owned(name)
    except (FileNotFoundError, BadSharedData):
        pass


class RankBoard:
    """The int64 array of one rank, mapped from its file (created by the rank; read-only for others)."""

    def __init__(self, path: Path, num_groups: int, *, create: bool):
        self.path = path
        size = (HEADER + num_groups) * 8
        directory = open_folder(path.parent, create=True) if create else _folder(path.parent)
        with directory:  # type: ignore[union-attr]
            fd = directory.create_sized(path.name, size) if create else directory.open_file(path.name, os.O_RDONLY)
        try:
            if not create and os.fstat(fd).st_size != size:
                raise BadSharedData(f"{path} is {os.fstat(fd).st_size} bytes, not the {size} of {num_groups} groups")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
            self._mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        array = np.frombuffer(self._mapping, dtype=np.int64)
        if create:
            array[DEVICE_FREE] = -1
        self.array = array
        self.header = array[:HEADER]
        self.groups = array[HEADER:]

    @classmethod
    def of_rank(cls, folder: Path, rank: int, num_groups: int, *, create: bool) -> "RankBoard":
        return cls(folder / f"rank{rank}.board", num_groups, create=create)

    def get(self, field: int) -> int:
        return int(self.header[field])

    def set(self, field: int, value: int) -> None:
        self.header[field] = value


def write_idle_commands(folder: Path, commands: Sequence[Command]) -> Path:
    first, last = commands[0][0], commands[-1][0]
    path = folder / f"idle-{first:012d}-{last:012d}.cmd"
    with _folder(folder) as directory:
        directory.write_atomic(path.name, encode_commands(commands))
    return path


def idle_files(folder: Path) -> list[tuple[int, int, Path]]:
    """Idle command files as (first, last, path), oldest first (other names are ignored)."""
    directory = open_folder(folder, create=False)
    if directory is None:
        return []
    with directory:
        names = directory.names("idle-")
    found = []
    for name in names:
        match = _IDLE.fullmatch(name)
        if match:
            found.append((int(match.group(1)), int(match.group(2)), folder / name))
    return sorted(found)


def read_idle_commands(path: Path) -> tuple[Command, ...]:
    with _folder(path.parent) as directory:
        data = directory.read_bytes(path.name, MAX_COMMANDS_BYTES)
    return decode_commands(data, str(path))
