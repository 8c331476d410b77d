"""Where account files live, and the locked read-modify-write cycle on one of them.

One file per GPU under ``/dev/shm`` (tmpfs: shared by every process of the
machine, gone at reboot, never touches a disk). All changes happen while the
writer holds ``fcntl.flock`` on the file: the kernel drops the lock of a process
that dies, so a holder killed mid-change never wedges the others. A flock
belongs to an open file description, so a forked child reopens the file before
locking (sharing the parent's description would mean sharing its lock), and a
thread lock serialises threads of one process around the flock.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kvelastic.cluster.errors import AccountCorrupt, AccountNotFound
from kvelastic.cluster.records import HEADER_SIZE, Header, MemberRecord, RECORD_SIZE, record_offset

DEFAULT_SHARED_DIR = "/dev/shm"
SHARED_DIR_ENV = "KVELASTIC_SHARED_DIR"
FILE_PREFIX = "kvelastic-"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def shared_dir() -> Path:
    """The directory of account files: ``$KVELASTIC_SHARED_DIR`` or ``/dev/shm``."""
    return Path(os.environ.get(SHARED_DIR_ENV) or DEFAULT_SHARED_DIR)


def account_path(gpu_id: str, directory: str | Path | None = None) -> Path:
    """``<dir>/kvelastic-<gpu_id>``, with characters unsafe in a file name replaced by ``_``."""
    if not gpu_id or not gpu_id.strip():
        raise ValueError("gpu_id must be a non-empty GPU identifier (for example the GPU's UUID)")
    base = Path(directory) if directory is not None else shared_dir()
    return base / (FILE_PREFIX + _UNSAFE.sub("_", gpu_id.strip()))


def find_account_paths(directory: str | Path | None = None) -> list[Path]:
    """Every file in the shared directory that looks like an account (by name and magic)."""
    base = Path(directory) if directory is not None else shared_dir()
    try:
        candidates = sorted(p for p in base.iterdir() if p.name.startswith(FILE_PREFIX) and p.is_file())
    except FileNotFoundError:
        return []
    found = []
    for path in candidates:
        try:
            with open(path, "rb") as handle:
                Header.unpack(handle.read(HEADER_SIZE))
        except (OSError, AccountCorrupt):
            continue
        found.append(path)
    return found


class AccountFile:
    """An open account file; :meth:`transaction` yields its records under the lock."""

    def __init__(self, path: Path, *, create_with: Header | None = None):
        """Open ``path``; create it with ``create_with`` when missing (else raise AccountNotFound)."""
        self.path = Path(path)
        self._create_with = create_with
        self._thread_lock = threading.Lock()
        self.read_only = False
        self._fd = -1
        self._owner_pid = -1
        self._open()

    # ------------------------------------------------------------ open/close
    def _open(self) -> None:
        flags = os.O_RDWR | (os.O_CREAT if self._create_with is not None else 0)
        if self._create_with is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, flags, 0o666)
        except FileNotFoundError:
            raise AccountNotFound(f"no kvelastic account at {self.path}") from None
        except PermissionError:
            if self._create_with is not None:
                raise
            fd, self.read_only = os.open(self.path, os.O_RDONLY), True
        self._fd, self._owner_pid = fd, os.getpid()
        with self._flock():
            self._initialise()

    def _initialise(self) -> None:
        """Write a fresh header if the file is new; check it otherwise."""
        size = os.fstat(self._fd).st_size
        if size == 0 and self._create_with is not None:
            header = self._create_with
            os.ftruncate(self._fd, header.file_size)
            os.pwrite(self._fd, header.pack(), 0)
            return
        header = Header.unpack(os.pread(self._fd, HEADER_SIZE, 0))
        if size < header.file_size:
            raise AccountCorrupt(f"{self.path} is {size} bytes, its header promises {header.file_size}")

    def close(self) -> None:
        if self._fd >= 0 and self._owner_pid == os.getpid():
            os.close(self._fd)
        self._fd = -1

    def _reopen_after_fork(self) -> None:
        """A forked child must not share its parent's open file description (nor lock)."""
        if self._owner_pid != os.getpid():
            self._thread_lock = threading.Lock()
            self._create_with = None
            self._open()

    # ----------------------------------------------------------------- locks
    @contextmanager
    def _flock(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_SH if self.read_only else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextmanager
    def transaction(self) -> Iterator["Snapshot"]:
        """Hold the lock and yield the header and every slot; ``Snapshot.write`` persists changes."""
        if self._fd < 0:
            raise AccountNotFound(f"account {self.path} was closed")
        self._reopen_after_fork()
        with self._thread_lock, self._flock():
            yield Snapshot(self)

    # ------------------------------------------------------------ raw access
    def read_header(self) -> Header:
        return Header.unpack(os.pread(self._fd, HEADER_SIZE, 0))

    def read_records(self, header: Header) -> list[MemberRecord]:
        data = os.pread(self._fd, header.slots * RECORD_SIZE, HEADER_SIZE)
        return [MemberRecord.unpack(data[i * RECORD_SIZE:(i + 1) * RECORD_SIZE], i)
                for i in range(header.slots)]

    def write_header(self, header: Header) -> None:
        os.pwrite(self._fd, header.pack(), 0)

    def write_record(self, record: MemberRecord) -> None:
        os.pwrite(self._fd, record.pack(), record_offset(record.slot))


class Snapshot:
    """The account as read under the lock; valid only inside its transaction."""

    def __init__(self, file: AccountFile):
        self.file = file
        self.header = file.read_header()
        self.records = file.read_records(self.header)
        self.now = time.time()

    @property
    def used(self) -> list[MemberRecord]:
        return [r for r in self.records if r.used]

    def free_slot(self) -> MemberRecord | None:
        return next((r for r in self.records if not r.used), None)

    def by_name(self, name: str) -> MemberRecord | None:
        return next((r for r in self.records if r.used and r.name == name), None)

    def write(self, record: MemberRecord) -> None:
        if not self.file.read_only:
            self.file.write_record(record)

    def write_header(self) -> None:
        if not self.file.read_only:
            self.file.write_header(self.header)
