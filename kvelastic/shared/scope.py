"""Who shares kvelastic's files, and the one directory they share them in.

By default only processes of the same user share a GPU's account: their files
live in ``$KVELASTIC_SHARED_DIR/kvelastic-u<uid>`` (mode 0700). With
``KVELASTIC_SHARED_GROUP`` set, the members of that group share
``kvelastic-g<gid>`` (mode 2770: the set-group-id bit makes every file created
in it belong to the group). Everyone else can see that such a directory exists,
and nothing more. Root is trusted everywhere (it can write any file anyway).
The shared directory itself must not be set-group-id to a group whose
members are not all trusted (``/dev/shm`` is not).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

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


def current_scope(root: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> Scope:
    """This process's scope: ``KVELASTIC_SHARED_DIR`` (or ``root``) and ``KVELASTIC_SHARED_GROUP``.

    Raises ``ConfigError`` for a relative or missing directory, or a group
    this process is not a member of.
    """
    from kvelastic.settings import shared_location

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
