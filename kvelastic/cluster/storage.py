"""Where account files live, and the locked read-modify-write cycle on one of them.

One file per GPU in the scope's directory under ``/dev/shm`` (tmpfs: shared
by every process of the machine, gone at reboot, never touches a disk; see
:mod:`kvelastic.shared.scope` for who shares it). A new account is written
whole to a temporary file and linked into place, so no process ever sees half
an account, and an existing one is never clobbered. All changes happen while
the writer holds ``fcntl.flock`` on the file, taken with a deadline: a holder
that is stopped (SIGSTOP, a paused container) costs the others a miss
(:class:`AccountBusy`), never a stall, and the kernel drops the lock of a
process that dies. A flock belongs to an open file description, so a forked
child reopens the file before locking, and a thread lock serialises threads of
one process around the flock.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kvelastic.cluster.errors import (AccountBusy, AccountCorrupt, AccountNotFound, AccountNotWritable,
                                      AccountVanished)
from kvelastic.cluster.records import HEADER_SIZE, RECORD_SIZE, Header, MemberRecord, record_offset, unpack_records
from kvelastic.shared.errors import LockBusy
from kvelastic.shared.files import SafeDir
from kvelastic.shared.locks import locked
from kvelastic.shared.names import ACCOUNT_PREFIX, account_name
from kvelastic.shared.scope import Scope, current_scope

DEFAULT_LOCK_TIMEOUT_S = 1.0


def shared_dir(root: str | Path | None = None) -> Path:
    """This process's directory of shared files: ``<KVELASTIC_SHARED_DIR>/kvelastic-u<uid>`` (or ``-g<gid>``)."""
    return current_scope(root).path


def account_path(gpu_id: str, root: str | Path | None = None) -> Path:
    """Where the account of ``gpu_id`` lives (unsafe characters of the id replaced by ``_``)."""
    return shared_dir(root) / account_name(gpu_id)


def find_account_paths(root: str | Path | None = None) -> list[Path]:
    """Every file of this scope named like an account, readable or not (``kvelastic status`` reports both)."""
    scope = current_scope(root)
    directory = SafeDir.open(scope.path, scope, create=False)
    if directory is None:
        return []
    with directory:
        return [scope.path / name for name in directory.names(ACCOUNT_PREFIX)]


class AccountFile:
    """An open account file; :meth:`transaction` yields its records under the lock."""

    def __init__(self, path: Path, *, create_with: Header | None = None, scope: Scope | None = None,
                 lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S):
        """Open ``path`` (in ``scope``'s directory); create it with ``create_with`` when missing.

        Without ``create_with`` a missing file raises AccountNotFound. A file
        this process may read but not write is opened read-only: reads work,
        writes raise AccountNotWritable.
        """
        self.path = Path(path)
        self.scope = scope or current_scope(self.path.parent.parent)
        if self.path.parent != self.scope.path:
            raise AccountNotFound(f"{self.path} is not in this process's shared directory {self.scope.path}")
        self.lock_timeout_s = lock_timeout_s
        self._create_with = create_with
        self._thread_lock = threading.Lock()
        self.writable = True
        self._fd = -1
        self._owner_pid = -1
        self._open()

    # ------------------------------------------------------------ open/close
    def _open(self) -> None:
        directory = SafeDir.open(self.scope.path, self.scope, create=self._create_with is not None)
        if directory is None:
            raise AccountNotFound(f"no kvelastic account at {self.path} (no directory {self.scope.path})")
        with directory:
            try:
                self._fd, self.writable = self._open_file(directory)
            except AccountNotFound:
                if self._create_with is None:
                    raise
                directory.create_new(self.path.name, _initial_content(self._create_with))  # or another did
                self._fd, self.writable = self._open_file(directory)
        self._owner_pid = os.getpid()
        try:
            with self.transaction() as snap:
                del snap  # reading the header and records once checks the file
        except BaseException:
            self.close()
            raise

    def _open_file(self, directory: SafeDir) -> tuple[int, bool]:
        try:
            return directory.open_file(self.path.name, os.O_RDWR), True
        except FileNotFoundError:
            raise AccountNotFound(f"no kvelastic account at {self.path}") from None
        except PermissionError:
            pass
        try:
            return directory.open_file(self.path.name, os.O_RDONLY), False
        except FileNotFoundError:
            raise AccountNotFound(f"no kvelastic account at {self.path}") from None

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

    # ------------------------------------------------------------ transaction
    @contextmanager
    def transaction(self, timeout_s: float | None = None) -> Iterator["Snapshot"]:
        """Hold the lock and yield the header and every slot; ``Snapshot.write`` persists changes.

        The lock is waited for at most ``timeout_s`` (default: the file's
        ``lock_timeout_s``); past it AccountBusy is raised and nothing happened.
        """
        if self._fd < 0:
            raise AccountNotFound(f"account {self.path} was closed")
        self._reopen_after_fork()
        timeout = self.lock_timeout_s if timeout_s is None else timeout_s
        try:
            with locked(self._thread_lock, self._fd, timeout, exclusive=self.writable, what=str(self.path)):
                yield Snapshot(self)
        except LockBusy as error:
            raise AccountBusy(str(error)) from None

    # ------------------------------------------------------------ raw access
    def read_all(self) -> tuple[Header, list[MemberRecord]]:
        """Header and records, checked; AccountVanished if the file was removed, AccountCorrupt if bad."""
        st = os.fstat(self._fd)
        if st.st_nlink == 0 or not self._still_at_path(st):
            raise AccountVanished(f"the account {self.path} was removed, renamed or replaced while open")
        try:
            header = Header.unpack(os.pread(self._fd, HEADER_SIZE, 0))
            if st.st_size < header.file_size:
                raise AccountCorrupt(f"{self.path} is {st.st_size} bytes, its header promises {header.file_size}")
            data = os.pread(self._fd, header.slots * RECORD_SIZE, HEADER_SIZE)
            records = unpack_records(data, header.slots)
        except (struct.error, UnicodeError) as error:
            raise AccountCorrupt(f"{self.path} cannot be read as an account: {error}") from None
        except AccountCorrupt as error:
            raise AccountCorrupt(f"{self.path}: {error}") from None
        return header, records

    def _still_at_path(self, st: os.stat_result) -> bool:
        """Whether the open file is the one its path names now (same device and inode).

        A file (or its folder) renamed aside stays linked, so its link count
        cannot tell; engines still holding it would share one account while
        newcomers create another at the path, and the budget would count twice.
        """
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

    def write_header(self, header: Header) -> None:
        self._pwrite(header.pack(), 0)

    def write_record(self, record: MemberRecord) -> None:
        self._pwrite(record.pack(), record_offset(record.slot))

    def _pwrite(self, data: bytes, offset: int) -> None:
        if not self.writable:
            raise AccountNotWritable(f"nothing changed: this process (uid {os.geteuid()}) may read the account "
                                     f"{self.path} but not change it (permission denied)")
        os.pwrite(self._fd, data, offset)


def _initial_content(header: Header) -> bytes:
    return header.pack() + bytes(header.slots * RECORD_SIZE)


class Snapshot:
    """The account as read under the lock; valid only inside its transaction."""

    def __init__(self, file: AccountFile):
        self.file = file
        self.header, self.records = file.read_all()
        # Wall-clock time: other processes read the times written with it (heartbeats, wants), so
        # their readers bound its age both ways (policy.recent, account.lease_holds).
        self.now = time.time()

    @property
    def used(self) -> list[MemberRecord]:
        return [r for r in self.records if r.used]

    def free_slot(self) -> MemberRecord | None:
        return next((r for r in self.records if not r.used), None)

    def by_name(self, name: str) -> MemberRecord | None:
        return next((r for r in self.records if r.used and r.name == name), None)

    def write(self, record: MemberRecord) -> None:
        self.file.write_record(record)

    def write_header(self) -> None:
        self.file.write_header(self.header)
