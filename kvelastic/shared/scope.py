"""Who shares kvelastic's files, and the one directory they share them in.

By default only processes of the same user share a GPU's account: their files
live in ``$KVELASTIC_SHARED_DIR/kvelastic-u<uid>`` (mode 0700). With
``KVELASTIC_SHARED_GROUP`` set, the members of that group share
``kvelastic-g<gid>`` (mode 2770: the set-group-id bit makes every file created
in it belong to the group). Everyone else can see that such a directory exists,
and nothing more. Root is trusted everywhere (it can write any file anyway).

The shared directory itself (the root, ``KVELASTIC_SHARED_DIR``) is checked
too (:meth:`Scope.check_root`): whoever may rename entries in it could move a
scope's folder aside and split its account in two, so it must belong to a
trusted user and, if others may write it, have the sticky bit (``/dev/shm``
and ``/tmp`` have). In a group scope it must not be set-group-id (a folder any
user created in it would get the group), and the scope's folder must belong to
this user, root or a member of the group.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from kvelastic.shared.location import shared_location

USER_PREFIX = "kvelastic-u"
GROUP_PREFIX = "kvelastic-g"
_SCOPE_DIR = re.compile(r"^kvelastic-[ug][0-9]+$")


@dataclass(frozen=True)
class Scope:
    """The processes that trust each other's kvelastic files: one uid, or the members of one group."""

    root: Path
    uid: int
    gid: int | None = None

    @property
    def dir_name(self) -> str:
        return f"{USER_PREFIX}{self.uid}" if self.gid is None else f"{GROUP_PREFIX}{self.gid}"

    @property
    def path(self) -> Path:
        return self.root / self.dir_name

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.gid is None else 0o2770

    @property
    def file_mode(self) -> int:
        return 0o600 if self.gid is None else 0o660

    def forbidden_mode_bits(self, directory: bool) -> int:
        """Bits no directory (nobody outside the scope may enter it) or file (nor write it) may have."""
        if directory:
            return 0o077 if self.gid is None else 0o007
        return 0o022 if self.gid is None else 0o002

    def trusts(self, st: os.stat_result) -> bool:
        """Whether a file or folder with status ``st`` may be believed.

        Its owner is this user or root; in a group scope, its group may be the
        scope's group instead: only members (and root) can give a file that
        group, and only they can create files in the scope's folder.
        """
        return st.st_uid in (self.uid, 0) or (self.gid is not None and st.st_gid == self.gid)

    def trusts_owner(self, uid: int) -> bool:
        """Whether ``uid`` may own what this scope relies on: this user, root, or in a group scope a member."""
        return uid in (self.uid, 0) or (self.gid is not None and is_group_member(uid, self.gid))

    def check_root(self, st: os.stat_result, what: str) -> None:
        """Raise UnsafeSharedPath unless the shared root ``st`` (of ``what``) keeps this scope's folder in place."""
        from kvelastic.shared.errors import UnsafeSharedPath

        fix = "use a directory like /dev/shm (root's, mode 1777), or set KVELASTIC_SHARED_DIR (docs/security.md)"
        if not self.trusts_owner(st.st_uid):
            raise UnsafeSharedPath(f"the shared directory {what} belongs to uid {st.st_uid}, who could move this "
                                   f"scope's folder aside; kvelastic refuses it: {fix}")
        mode = st.st_mode
        group_ok = st.st_gid == (self.gid if self.gid is not None else os.getegid())
        if not mode & stat.S_ISVTX and (mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not group_ok)):
            raise UnsafeSharedPath(f"the shared directory {what} has mode {stat.S_IMODE(mode):o}: others may "
                                   f"write it and, without the sticky bit, rename this scope's folder (splitting "
                                   f"its account); kvelastic refuses it: its owner can chmod +t it, or {fix}")
        if self.gid is not None and mode & stat.S_ISGID:
            raise UnsafeSharedPath(f"the shared directory {what} is set-group-id (mode {stat.S_IMODE(mode):o}): a "
                                   f"folder anyone creates in it gets its group, so kvelastic refuses it for the "
                                   f"group scope of {self.gid}: {fix}")

    def check(self, st: os.stat_result, what: str) -> None:
        """Raise UnsafeSharedPath unless ``st`` (of ``what``) is owned and protected as this scope requires.

        A directory must keep everyone outside the scope out (0700, or 2770
        for a group); a file, in such a directory, only needs to keep them from
        writing it.
        """
        from kvelastic.shared.errors import UnsafeSharedPath

        if not self.trusts(st):
            raise UnsafeSharedPath(f"{what} belongs to uid {st.st_uid} (group {st.st_gid}), whom this process "
                                   f"(uid {self.uid}) does not trust; kvelastic never uses another user's files "
                                   f"(docs/security.md). Its owner or root must remove it")
        if st.st_mode & self.forbidden_mode_bits(stat.S_ISDIR(st.st_mode)):
            raise UnsafeSharedPath(f"{what} has mode {stat.S_IMODE(st.st_mode):o}: others than {self.describe()} "
                                   f"could change it; kvelastic refuses to use it (chmod it, or remove it)")
        if self.gid is not None and st.st_gid != self.gid:
            raise UnsafeSharedPath(f"{what} belongs to group {st.st_gid}, not to the shared group {self.gid}")

    def describe(self) -> str:
        return f"uid {self.uid}" if self.gid is None else f"the members of group {self.gid}"


@functools.lru_cache(maxsize=64)
def is_group_member(uid: int, gid: int) -> bool:
    """Whether the user database makes ``uid`` a member of group ``gid`` (its primary group, or listed in it).

    A uid the database does not know is no member: its membership cannot be shown.
    """
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    if user.pw_gid == gid:
        return True
    try:
        return user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def current_scope(root: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> Scope:
    """This process's scope: ``KVELASTIC_SHARED_DIR`` (or ``root``) and ``KVELASTIC_SHARED_GROUP``.

    Raises ``ConfigError`` for a relative or missing directory, or a group
    this process is not a member of.
    """
    where, gid = shared_location(environ)
    return Scope(Path(root) if root is not None else where, os.geteuid(), gid)


def is_scope_dir_name(name: str) -> bool:
    """Whether ``name`` is a scope's folder name: ``kvelastic-u<uid>`` or ``kvelastic-g<gid>``, nothing more."""
    return _SCOPE_DIR.fullmatch(name) is not None


def other_scopes(scope: Scope) -> list[str]:
    """Names of other users' or groups' kvelastic folders beside ``scope``'s (looked at, never opened).

    Engines of another scope on the same GPU are not counted by this scope's
    account; the engine says so when it joins rather than running unshared
    without a word. Only folders named exactly like a scope's count.
    """
    try:
        names = os.listdir(scope.root)
    except OSError:
        return []
    return sorted(n for n in names if n != scope.dir_name and is_scope_dir_name(n) and _is_folder(scope.root / n))


def _is_folder(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
