"""What each file in a scope's directory is called, and whose process it belongs to.

Every name of a file one process owns carries that process's pid
namespace, pid and start time, so the sweeper can tell, from the name alone,
whether its owner is provably dead (:mod:`kvelastic.shared.sweep`); a pid
reused by a new process, or a pid of another pid namespace, never counts as
dead.
"""

from __future__ import annotations

import os
import re
import secrets
import unicodedata
from typing import NamedTuple

ACCOUNT_PREFIX = "account-"
STATS_PREFIX = "stats-"
STATS_SUFFIX = ".json"
TEMP_PREFIX = ".tmp-"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_OWNED = re.compile(r"^(?:\.tmp-|stats-)(\d+)-(\d+)-(\d+)(?:[-.].*)?$")
#: The longest instance name: it fills its account record's name field exactly (ASCII: one byte a character).
INSTANCE_NAME_MAX = 64
#: What an instance name may be, wherever one is accepted (settings, CLI, launcher, account).
INSTANCE_NAME_FORM = f"1-{INSTANCE_NAME_MAX} ASCII letters, digits, '.', '_' or '-'"
_INSTANCE_NAME = re.compile(r"[A-Za-z0-9._-]{1,%d}" % INSTANCE_NAME_MAX)
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class Owner(NamedTuple):
    """The process a file belongs to: pid namespace (inode of ``/proc/<pid>/ns/pid``), pid, start time."""

    pid_ns: int
    pid: int
    start_time: int


def own_owner() -> Owner:
    from kvelastic.cluster.liveness import own_pid_namespace, own_start_time

    return Owner(own_pid_namespace(), os.getpid(), own_start_time())


def is_instance_name(text: object) -> bool:
    """Whether ``text`` is a valid instance name (:data:`INSTANCE_NAME_FORM`), checked whole."""
    return isinstance(text, str) and _INSTANCE_NAME.fullmatch(text) is not None


def derived_instance_name(source: str, suffix: str | int, fallback: str = "model") -> str:
    """A valid instance name ``<base>-<suffix>`` made from free text (a model folder's name).

    Accents are dropped (``modèle`` gives ``modele``), every other character
    outside the name's alphabet becomes ``-``; a base with no ASCII letter or
    digit left (``模型``) is ``fallback``. The base is cut so the whole fits.
    """
    ascii_text = unicodedata.normalize("NFKD", source).encode("ascii", "ignore").decode("ascii")
    base = _NAME_UNSAFE.sub("-", ascii_text).strip("-.")
    if not any(c.isalnum() for c in base):
        base = fallback
    tail = f"-{suffix}"
    name = base[:INSTANCE_NAME_MAX - len(tail)].rstrip("-.") + tail
    assert is_instance_name(name), name
    return name


def account_name(gpu_id: str) -> str:
    """``account-<gpu id>``, with characters unsafe in a file name replaced by ``_``."""
    if not gpu_id or not gpu_id.strip():
        raise ValueError("gpu_id must be a non-empty GPU identifier (for example the GPU's UUID)")
    return ACCOUNT_PREFIX + _UNSAFE.sub("_", gpu_id.strip())[:200]


def gpu_of_account(name: str) -> str:
    """The (file-name-safe) GPU id an account file name stands for."""
    return name[len(ACCOUNT_PREFIX):]


def _owned(prefix: str, owner: Owner, tail: str) -> str:
    return f"{prefix}{owner.pid_ns}-{owner.pid}-{owner.start_time}{tail}"


def stats_name(owner: Owner, number: int) -> str:
    return _owned(STATS_PREFIX, owner, f"-{number}{STATS_SUFFIX}")


def temp_name() -> str:
    """A fresh name for a file being written, unique, marked with this process (see :func:`owner_of`)."""
    return _owned(TEMP_PREFIX, own_owner(), f"-{secrets.token_hex(6)}")


def owner_of(name: str) -> Owner | None:
    """The process a stats file or temporary file belongs to, read from its name."""
    match = _OWNED.fullmatch(name)
    if match is None:
        return None
    return Owner(*(int(g) for g in match.groups()))
