"""Where ranks and their scheduler meet: one folder in shared memory per engine.

The folder is named after the engine-core process (the workers' parent: its pid
and start time), so the scheduler and its ranks find each other without any
extra configuration, and a reused pid never finds an old engine's files. Each
rank writes two files there and nothing else:

* ``rank<r>.info``: what the scheduler needs to plan (the group layout, bytes
  per group, the physical limit vLLM profiled, host-tier slots), written once;
* ``rank<r>.board``: a small int64 array the rank keeps current: its pid, the
  last command and step it applied, free device bytes, and per page group the
  number of the command that mapped it (negative: refused; 0: unmapped).

A single writer per file needs no lock; the scheduler only reads them.
Commands sent while the engine is idle are dropped into the folder as
``idle-<first>-<last>.cmd`` files, which the scheduler writes and removes.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvelastic.tp.protocol import Command

HEADER = 8
PID, APPLIED, STEPS_DONE, DEVICE_FREE, MAPPED_BYTES, HELD_BYTES = range(6)


def engine_dir(engine_pid: int, root: str | os.PathLike | None = None) -> Path:
    """The engine's folder, named by its pid and start time: a reused pid never finds old files."""
    from kvelastic.cluster.liveness import process_start_time
    from kvelastic.cluster.storage import shared_dir

    base = Path(root) if root else shared_dir()
    return base / f"kvelastic-engine-{engine_pid}-{process_start_time(engine_pid)}"


@dataclass(frozen=True)
class RankInfo:
    """A rank's description of its KV cache, for the scheduler."""

    rank: int
    world: int
    pid: int
    layout: Any            # the rank's KVGroupLayout (identical on every rank)
    group_bytes: int
    page_bytes: int
    limit_bytes: int | None
    host_slots: int        # 0 without a host tier
    slot_bytes: int


def write_atomic(path: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as out:
        out.write(payload)
    os.replace(tmp, path)


def write_info(folder: Path, info: RankInfo) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / f"rank{info.rank}.info", pickle.dumps(info))


def read_info(folder: Path, rank: int) -> RankInfo | None:
    try:
        return pickle.loads((folder / f"rank{rank}.info").read_bytes())
    except FileNotFoundError:
        return None


class RankBoard:
    """The int64 array of one rank, mapped from its file (created by the rank)."""

    def __init__(self, path: Path, num_groups: int, *, create: bool):
        self.path = path
        shape = (HEADER + num_groups,)
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            array = np.memmap(path, dtype=np.int64, mode="w+", shape=shape)
            array[:] = 0
            array[DEVICE_FREE] = -1
        else:
            array = np.memmap(path, dtype=np.int64, mode="r", shape=shape)
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
    write_atomic(path, pickle.dumps(tuple(commands)))
    return path


def idle_files(folder: Path) -> list[tuple[int, int, Path]]:
    """Idle command files as (first, last, path), oldest first."""
    found = []
    for path in folder.glob("idle-*.cmd"):
        _, first, last = path.stem.split("-")
        found.append((int(first), int(last), path))
    return sorted(found)


def read_idle_commands(path: Path) -> tuple[Command, ...]:
    return pickle.loads(path.read_bytes())
