"""Many kvelastic processes on one GPU, sharing one account of physical KV bytes.

``SharedAccount.open(gpu_id, budget)`` opens (or creates) the GPU's account
file in this user's folder under ``/dev/shm`` (``$KVELASTIC_SHARED_DIR``
overrides the directory; who shares it: ``docs/security.md``);
``account.join(name, ...)`` makes this process a :class:`Member`, whose grants
gate page creation through :class:`SharedBudgetSource` and whose
:meth:`Member.tick` the reclaimer calls to publish usage and learn limits and
pressure. An engine holds its membership through a :class:`Membership`, which
no trouble with the account can make raise. The ``kvelastic`` CLI reads and
changes the same files. Importing this package touches neither torch nor CUDA.
"""

from __future__ import annotations

from kvelastic.cluster.account import SharedAccount
from kvelastic.cluster.errors import (AccountBusy, AccountCorrupt, AccountFull, AccountingError, AccountNotFound,
                                      AccountNotWritable, AccountVanished, BadLimits, ClusterError, MemberGone,
                                      NameInUse, SharedBudgetExceeded, UnknownMember)
from kvelastic.cluster.info import MemberInfo, MemberTick
from kvelastic.cluster.member import Grant, Member
from kvelastic.cluster.membership import Membership
from kvelastic.cluster.source import SharedBudgetSource
from kvelastic.cluster.storage import account_path, find_account_paths, shared_dir

__all__ = [
    "AccountBusy", "AccountCorrupt", "AccountFull", "AccountNotFound", "AccountNotWritable", "AccountVanished",
    "AccountingError", "BadLimits", "ClusterError", "Grant", "Member", "MemberGone", "MemberInfo", "MemberTick",
    "Membership", "NameInUse", "SharedAccount", "SharedBudgetExceeded", "SharedBudgetSource", "UnknownMember",
    "account_path", "find_account_paths", "shared_dir",
]
