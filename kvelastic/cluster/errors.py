"""Typed exceptions of the shared per-GPU account.

Each failure a caller handles differently has its own class: a refused grant
is a scheduling miss (a :class:`~kvelastic.errors.PoolExhausted`), a name
clash or an impossible reservation stops start-up with a precise message, and
an unknown instance is what the CLI turns into exit code 3.
"""

from __future__ import annotations

from kvelastic.errors import ConfigError, KvelasticError, PoolExhausted


class ClusterError(KvelasticError):
    """Base class of every error of the shared account."""


class AccountNotFound(ClusterError):
    """No account file exists for the GPU (or none at all in the shared directory)."""


class AccountVanished(AccountNotFound):
    """The account file this process had open was removed or replaced (``kvelastic reset``, ``rm``)."""


class AccountCorrupt(ClusterError):
    """The file is not a kvelastic account, was written by an incompatible version, or holds out-of-range values."""


class AccountBusy(ClusterError):
    """Another process held the account's lock past the deadline: nothing happened, try again later."""


class AccountNotWritable(ClusterError):
    """This process may read the account but not change it."""


class AccountFull(ClusterError):
    """Every member slot of the account is held by a live process."""


class NameInUse(ClusterError):
    """A live process already holds this instance name in the account."""

    def __init__(self, message: str, *, name: str, pid: int):
        super().__init__(message)
        self.name = name
        self.pid = pid


class UnknownMember(ClusterError, LookupError):
    """No live member of the account has this name."""

    def __init__(self, message: str, *, name: str):
        super().__init__(message)
        self.name = name


class BadLimits(ClusterError, ValueError):
    """Limits that cannot hold: max below min, negative, or reservations above the budget."""


class BadName(ClusterError, ValueError):
    """An instance name outside its alphabet (``kvelastic.shared.names.INSTANCE_NAME_FORM``)."""


class MemberGone(ClusterError):
    """This member's record is no longer in the account (it left, or was pruned as dead)."""


class SharedBudgetExceeded(PoolExhausted):
    """The GPU's shared budget (or this member's cap in it) refused more physical bytes."""


class AccountingError(ClusterError, ValueError):
    """A member gave back more than it holds, or asked for a negative amount: a caller bug."""


class LaunchConfigError(ConfigError):
    """A launch plan (command line or YAML file) that cannot be run as written."""


class LaunchFailed(ClusterError):
    """A server of a launch exited, or did not become ready in time."""


class AccountInUse(ClusterError):
    """A readable account with live members was not reset (``--force`` resets it anyway)."""


class AccountNotOwned(ClusterError):
    """Only the owner of an account file may remove it; this process's user is not."""
