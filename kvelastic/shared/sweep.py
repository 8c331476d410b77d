"""Remove what dead processes left in a scope's directory: metrics snapshots and temporary files.

An engine killed with SIGKILL never removes its metrics snapshot, and a writer killed mid-write leaves its temporary file;
tmpfs keeps them until reboot. The next engine and ``kvelastic status`` sweep
them: only entries this user owns, only of processes of this pid namespace that
are provably dead (their names say which process they belong to:
:mod:`kvelastic.shared.names`). Sweeping never raises.
"""

from __future__ import annotations

import logging
import stat

from kvelastic.shared.files import SafeDir
from kvelastic.shared.names import owner_of

log = logging.getLogger("kvelastic")


def sweep(directory: SafeDir) -> list[str]:
    """Remove the dead processes' entries of ``directory``; returns the names removed."""
    from kvelastic.cluster.liveness import provably_dead

    removed = []
    try:
        for name, st in list(directory.entries()):
            owner = owner_of(name)
            if owner is None or stat.S_ISDIR(st.st_mode) or not provably_dead(*owner):
                continue
            if directory.unlink_owned(name):
                removed.append(name)
    except OSError as error:  # the directory went away, or a file system error: try again next time
        log.debug("kvelastic: sweeping %s stopped: %s", directory.path, error)
    if removed:
        log.info("kvelastic: removed %d file(s) of dead engines from %s", len(removed), directory.path)
    return removed


def sweep_scope(root: str | None = None) -> list[str]:
    """:func:`sweep` this process's scope folder, if it exists (never raises)."""
    from kvelastic.shared.errors import SharedFileError
    from kvelastic.shared.scope import current_scope

    try:
        scope = current_scope(root)
        folder = SafeDir.open(scope.path, scope, create=False)
    except (SharedFileError, OSError) as error:
        log.debug("kvelastic: not sweeping the shared folder: %s", error)
        return []
    if folder is None:
        return []
    with folder:
        return sweep(folder)
