"""Removing a GPU's account: the way out of a corrupt one, and of records no process can prove dead.

An engine that loses its account (the file is gone) creates and joins a fresh
one on its next tick, handing it what it holds, so removing the file is a
complete reset. Only the file's owner may do it: kvelastic never unlinks
another user's file.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvelastic.cluster.account import SharedAccount
from kvelastic.cluster.errors import AccountBusy, AccountCorrupt, AccountInUse, AccountNotFound, AccountNotOwned
from kvelastic.cluster.storage import account_path
from kvelastic.shared.errors import SharedFileError
from kvelastic.shared.files import SafeDir
from kvelastic.shared.scope import current_scope


def reset_account(gpu_id: str, *, force: bool = False) -> tuple[Path, str | None]:
    """Remove ``gpu_id``'s account; returns its path and why it could not be read (None if it could).

    A readable account with live members is removed only with ``force``
    (AccountInUse otherwise).
    """
    path = account_path(gpu_id)
    problem = None
    try:
        account = SharedAccount.attach(path)
    except AccountBusy as error:  # a member stopped inside a transaction, or just a busy moment
        if not force:
            raise AccountInUse(f"{error}; --force resets it anyway") from None
        problem = str(error)
    except (AccountCorrupt, SharedFileError) as error:
        problem = str(error)
    else:
        with account:
            live = account.members()
        if live and not force:
            raise AccountInUse(f"the account of GPU {gpu_id!r} is readable and has {len(live)} live instance(s); "
                               f"--force resets it anyway (they rejoin a fresh account)")
    _remove(path)
    return path, problem


def _remove(path: Path) -> None:
    scope = current_scope()
    folder = SafeDir.open(scope.path, scope, create=False)
    if folder is None:
        raise AccountNotFound(f"no kvelastic account at {path}")
    with folder:
        try:
            owner = os.stat(path.name, dir_fd=folder.fd, follow_symlinks=False).st_uid
        except FileNotFoundError:
            raise AccountNotFound(f"no kvelastic account at {path}") from None
        if not folder.unlink_owned(path.name):
            raise AccountNotOwned(f"{path} belongs to uid {owner}; only its owner may remove it")
