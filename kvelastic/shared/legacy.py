"""The account file an older kvelastic kept straight in the shared directory.

Before accounts moved into one folder per scope (``kvelastic-u<uid>``,
``kvelastic-g<gid>``: :mod:`kvelastic.shared.scope`), kvelastic kept a GPU's
account as ``$KVELASTIC_SHARED_DIR/kvelastic-<gpu id>`` (``kvelastic-gpu-<uuid>``
for a GPU). An engine of that version still running on the GPU is not counted
in today's account; once none runs, the file is a leftover that tmpfs keeps
until reboot. The engine names it when it joins, with whose it is and how it
goes away. The file is looked at (``lstat``), never opened.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
from dataclasses import dataclass
from pathlib import Path

from kvelastic.shared.scope import Scope

LEGACY_ACCOUNT_PREFIX = "kvelastic-"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")  # what that version replaced by '_' in a GPU id


@dataclass(frozen=True)
class LegacyAccount:
    """An older kvelastic's account file for this GPU, and the uid that owns it."""

    path: Path
    uid: int

    def describe(self, scope: Scope) -> str:
        """What the file is, what it means for the account, and who can remove it, in one sentence."""
        what = (f"{self.path} is the account file of an older kvelastic (before accounts moved into per-user "
                f"folders such as {scope.path}): an engine of that version on this GPU is not counted in this "
                f"account")
        if self.uid == scope.uid:
            return f"{what}. If none runs, the file is a leftover; remove it with: rm {shlex.quote(str(self.path))}"
        return f"{what}. It belongs to uid {self.uid}; only that user or root can remove it"


def legacy_account_name(gpu_id: str) -> str:
    """The name the older kvelastic gave ``gpu_id``'s account file."""
    return LEGACY_ACCOUNT_PREFIX + _UNSAFE.sub("_", gpu_id.strip())


def legacy_account(scope: Scope, gpu_id: str) -> LegacyAccount | None:
    """The older kvelastic's account file of ``gpu_id`` in ``scope``'s shared directory; None if there is none.

    Only a regular file counts (what that version wrote); a link or a folder of that name is not its file.
    """
    path = scope.root / legacy_account_name(gpu_id)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return LegacyAccount(path, st.st_uid) if stat.S_ISREG(st.st_mode) else None
