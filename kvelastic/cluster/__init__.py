"""Many kvelastic processes on one GPU, sharing one account of physical KV bytes.

``SharedAccount.open(gpu_id, budget)`` opens (or creates) the GPU's account
file under ``/dev/shm`` (``$KVELASTIC_SHARED_DIR`` overrides the directory);
``account.join(name, ...)`` makes this process a :class:`Member`, whose grants
gate page creation through :class:`SharedBudgetSource` and whose
:meth:`Member.tick` the reclaimer calls to publish usage and learn limits and
pressure. The ``kvelastic`` CLI reads and changes the same files. Importing
this package touches neither torch nor CUDA.
"""

from __future__ import annotations

from kvelastic.cluster.account import SharedAccount
from kvelastic.cluster.errors import (AccountCorrupt, AccountFull, AccountingError, AccountNotFound,
                                      BadLimits, ClusterError, MemberGone, NameInUse,
                                      SharedBudgetExceeded, UnknownMember)
from kvelastic.cluster.info import MemberInfo, MemberTick
from kvelastic.cluster.member import Grant, Member
from kvelastic.cluster.source import SharedBudgetSource
from kvelastic.cluster.storage import SHARED_DIR_ENV, account_path, find_account_paths, shared_dir

__all__ = [
    "AccountCorrupt", "AccountFull", "AccountNotFound", "AccountingError", "BadLimits", "ClusterError",
    "Grant", "Member", "MemberGone", "MemberInfo", "MemberTick", "NameInUse", "SHARED_DIR_ENV",
    "SharedAccount", "SharedBudgetExceeded", "SharedBudgetSource", "UnknownMember", "account_path",
    "find_account_paths", "shared_dir",
]
