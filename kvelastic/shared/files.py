"""A checked, open directory of a scope, and the only ways kvelastic touches files in it.

Every operation goes through the directory's descriptor (``dir_fd``), so a
path is resolved once, from a directory whose owner and mode were checked when
it was opened (every time it is opened, not only when created). Files are
opened with ``O_NOFOLLOW`` (a planted symlink fails, it is never followed) and
``O_NONBLOCK`` (a planted FIFO cannot hang the opener), then ``fstat``-checked:
a regular file of a trusted owner, or nothing. Writes go to a temporary file
first and are renamed or linked into place, so a reader sees a whole file or
none; a full file system is reported as :class:`NoSpace` at write time.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Iterator

from kvelastic.shared.errors import BadSharedData, NoSpace, UnsafeSharedPath
from kvelastic.shared.names import temp_name
from kvelastic.shared.scope import Scope

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def no_space(error: OSError, path: Path | str, what: str) -> OSError | NoSpace:
    """``error`` as NoSpace when the file system is full (other errors unchanged), naming what failed."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return error
    return NoSpace(f"no space left to write {what} in {path}: its file system is full (a Docker container's "
                   f"/dev/shm is 64 MiB unless started with --shm-size; or set KVELASTIC_SHARED_DIR)")


class SafeDir:
    """An open directory that passed its scope's checks; closes with ``with`` or :meth:`close`."""

    def __init__(self, fd: int, path: Path, scope: Scope):
        self.fd = fd
        self.path = path
        self.scope = scope

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: Path, scope: Scope, *, create: bool) -> "SafeDir | None":
        """``path`` checked for ``scope`` (created if missing and ``create``); None if missing otherwise.

        The parent (``KVELASTIC_SHARED_DIR``, the administrator's choice) may
        be reached through a symlink, as ``/dev/shm`` is on some systems; the
        directory itself never is. The parent's owner and mode are checked
        (:meth:`Scope.check_root`): nobody untrusted may rename the folder.
        """
        try:
            parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if create:
                raise
            return None
        try:
            scope.check_root(os.fstat(parent), str(path.parent))
            return cls._open_in(parent, path, scope, create, scope_folder=True)
        finally:
            os.close(parent)

    @classmethod
    def _open_in(cls, parent: int, path: Path, scope: Scope, create: bool,
                 scope_folder: bool = False) -> "SafeDir | None":
        """``path`` (a name in the open directory ``parent``), checked; ``scope_folder``: the scope's own
        folder, whose owner must be trusted too (:meth:`Scope.trusts_owner`)."""
        created = False
        if create:
            try:
                os.mkdir(path.name, 0o700, dir_fd=parent)
                created = True
            except FileExistsError:
                pass
            except OSError as error:
                raise no_space(error, path, "a directory") from None
        try:
            fd = os.open(path.name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            if create:
                raise
            return None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeSharedPath(f"{path} is a symlink or not a directory; kvelastic never follows a "
                                       f"planted link (docs/security.md). Its owner or root must remove it") from None
            raise
        try:
            if created:
                if scope.gid is not None:
                    os.fchown(fd, -1, scope.gid)
                os.fchmod(fd, scope.dir_mode)  # mkdir's mode passed through the umask
            st = os.fstat(fd)
            scope.check(st, f"directory {path}")
            if scope_folder and not scope.trusts_owner(st.st_uid):  # made by a member or root, not a past member
                raise UnsafeSharedPath(f"directory {path} belongs to uid {st.st_uid}, not a member of group "
                                       f"{scope.gid} as the user database lists them; kvelastic refuses it. Its "
                                       f"owner or root must remove it; root may make it for the group: mkdir "
                                       f"{path} && chgrp {scope.gid} {path} && chmod 2770 {path}")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, scope)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SafeDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- files
    def open_file(self, name: str, flags: int, *, create: bool = False) -> int:
        """A descriptor of regular file ``name`` of a trusted owner (``create``: a new one, never an old one)."""
        flags |= _OPEN | ((os.O_CREAT | os.O_EXCL) if create else 0)
        try:
            fd = os.open(name, flags, self.scope.file_mode, dir_fd=self.fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafeSharedPath(f"{self.path / name} is a symlink; kvelastic never follows one") from None
            raise no_space(error, self.path, name) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeSharedPath(f"{self.path / name} is not a regular file (a FIFO, socket, device or "
                                       f"directory); kvelastic refuses to read or write it")
            if create:
                os.fchmod(fd, self.scope.file_mode)
            else:
                self.scope.check(st, f"file {self.path / name}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        """The whole content of ``name``; BadSharedData if it is larger than ``max_bytes``."""
        fd = self.open_file(name, os.O_RDONLY)
        try:
            return read_bounded(fd, max_bytes, self.path / name)
        finally:
            os.close(fd)

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data`` in one step (a reader sees the old file or the new one)."""
        tmp = self._write_temp(data, name)
        try:
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self._discard(tmp)
            raise

    def create_new(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data``, whole or not at all; False if ``name`` already exists."""
        tmp = self._write_temp(data, name)
        try:
            os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileExistsError:
            return False
        except OSError as error:
            raise no_space(error, self.path, name) from None
        finally:
            self._discard(tmp)

    def create_sized(self, name: str, size: int) -> int:
        """A new zero-filled file of ``size`` bytes with every block allocated now, open read-write.

        ``posix_fallocate`` makes a full file system an error here, at
        creation, instead of a SIGBUS when a page of a sparse mapping is first
        touched. An old file of this process's own user is replaced.
        """
        self.unlink_owned(name)
        fd = self.open_file(name, os.O_RDWR, create=True)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            os.close(fd)
            self._discard(name)
            raise no_space(error, self.path, f"{name} ({size} bytes)") from None
        return fd

    def _write_temp(self, data: bytes, purpose: str) -> str:
        tmp = temp_name()
        fd = self.open_file(tmp, os.O_WRONLY, create=True)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as error:
            os.close(fd)
            self._discard(tmp)
            raise no_space(error, self.path, purpose) from None
        os.close(fd)
        return tmp

    def _discard(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except OSError:
            pass

    # ---------------------------------------------------------- listing
    def names(self, prefix: str = "") -> list[str]:
        """Entry names starting with ``prefix``, sorted (nothing is opened)."""
        return sorted(n for n in os.listdir(self.fd) if n.startswith(prefix))

    def entries(self, prefix: str = "") -> Iterator[tuple[str, os.stat_result]]:
        """``(name, lstat)`` of entries starting with ``prefix``; entries that vanish meanwhile are skipped."""
        for name in self.names(prefix):
            try:
                yield name, os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue

    # --------------------------------------------------------- removing
    def unlink_owned(self, name: str) -> bool:
        """Remove ``name`` if this process's user owns it (never another user's file); True if removed."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if st.st_uid != os.geteuid() or stat.S_ISDIR(st.st_mode):
            return False
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True


def read_bounded(fd: int, max_bytes: int, what: Path | str) -> bytes:
    """At most ``max_bytes`` from ``fd``; BadSharedData if there is more."""
    size = os.fstat(fd).st_size
    if size > max_bytes:
        raise BadSharedData(f"{what} is {size} bytes, more than the {max_bytes} kvelastic ever writes there")
    chunks, left = [], max_bytes + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise BadSharedData(f"{what} grew past {max_bytes} bytes while it was read")
    return data
