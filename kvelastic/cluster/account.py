"""One GPU's physical KV bytes, shared by every kvelastic process that uses it.

Several vLLM processes on one GPU each map KV memory on demand; without a
common account the first burst of one would starve the others. Each process
joins the GPU's account as a named member and asks it before creating
physical pages (:meth:`Member.acquire`), gives bytes back after destroying
them (:meth:`Member.release`), and on every upkeep tick reports its cached and
host-tier bytes and learns its limits and how much it should give back
(:meth:`Member.tick`). Operators read and change the same file with the
``kvelastic`` CLI. The rules are in :mod:`kvelastic.cluster.policy`; the file
and its lock in :mod:`kvelastic.cluster.storage`.

Members of processes that died are pruned by whoever takes the lock next: the
driver freed their GPU memory when they exited, so their bytes return to the
budget at once. A member of this pid namespace is pruned once provably dead
(its process is gone). One of another pid namespace (another container sharing
``/dev/shm``) cannot be looked up from here; it holds a lease instead, renewed
by its heartbeat (every upkeep tick, four a second, and every grant): silent
for ``LEASE_S`` (a container that is gone, or paused that long), it is pruned,
and its name is free again. A paused engine that resumes finds its record gone
and rejoins (:class:`~kvelastic.cluster.membership.Membership`).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kvelastic.cluster import policy
from kvelastic.cluster.errors import AccountFull, BadLimits, BadName, NameInUse, UnknownMember
from kvelastic.cluster.info import MemberInfo
from kvelastic.cluster.liveness import own_pid_namespace, own_start_time, provably_dead
from kvelastic.cluster.records import DEFAULT_SLOTS, MAX_SLOTS, Header, MemberRecord
from kvelastic.cluster.storage import DEFAULT_LOCK_TIMEOUT_S, AccountFile, Snapshot, account_path
from kvelastic.cluster.member import Member
from kvelastic.shared.names import INSTANCE_NAME_FORM, is_instance_name
from kvelastic.units import MAX_BYTES, MAX_BYTES_TEXT, format_size

ALIVE_RECHECK_S = 0.2
#: How long a member of another pid namespace stays a member without a heartbeat: 60 missed upkeep ticks.
LEASE_S = 15.0


def _check_budget(budget_bytes: int) -> None:
    if not 0 < budget_bytes <= MAX_BYTES:
        raise BadLimits(f"the budget must be positive and at most {MAX_BYTES_TEXT}, not {budget_bytes}")


def _check_limits(name: str, min_bytes: int, max_bytes: int) -> None:
    if min_bytes < 0 or max_bytes < 0:
        raise BadLimits(f"limits of {name!r} must not be negative (min {min_bytes}, max {max_bytes})")
    if min_bytes > MAX_BYTES or max_bytes > MAX_BYTES:
        raise BadLimits(f"limits of {name!r} must be at most {MAX_BYTES_TEXT} (min {min_bytes}, max {max_bytes})")
    if max_bytes and max_bytes < min_bytes:
        raise BadLimits(f"max of {name!r} ({format_size(max_bytes)}) is below its min "
                        f"({format_size(min_bytes)})")


def _check_reservations(snap: Snapshot, name: str, min_bytes: int) -> None:
    """The reservations of all members together must fit the budget."""
    others = sum(r.min_bytes for r in snap.used if r.name != name)
    budget = snap.header.budget_bytes
    if others + min_bytes > budget:
        raise BadLimits(f"min {format_size(min_bytes)} for {name!r} does not fit: the other members "
                        f"reserve {format_size(others)} of the {format_size(budget)} budget")


def lease_holds(record: MemberRecord, now: float, lease_s: float) -> bool:
    """Whether ``record`` heartbeat within ``lease_s`` of ``now`` (wall-clock times: shared between processes).

    The age is bounded both ways: a heartbeat more than the lease ahead of
    ``now`` (the wall clock stepped back, or a forged time) does not keep a
    silent record forever; a live member rewrites it within a tick.
    """
    return policy.recent(record.heartbeat, now, lease_s)


class SharedAccount:
    """The account file of one GPU. Safe to use from several threads."""

    def __init__(self, file: AccountFile, *, want_ttl_s: float = policy.DEFAULT_WANT_TTL_S,
                 lease_s: float = LEASE_S):
        self._file = file
        self.want_ttl_s = want_ttl_s
        self.lease_s = lease_s
        self._seen_alive: dict[tuple[int, int], float] = {}  # (pid, start) -> monotonic time checked

    # ----------------------------------------------------------------- open
    @classmethod
    def open(cls, gpu_id: str, budget_bytes: int, *, claim_budget: bool = False,
             directory: str | Path | None = None, slots: int = DEFAULT_SLOTS,
             lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> "SharedAccount":
        """Create the GPU's account with ``budget_bytes``, or open the existing one.

        An existing account keeps its budget: the members that run decided it
        (or ``kvelastic budget`` did), and a newcomer must not silently shrink
        what they count on. With ``claim_budget`` an existing account that no
        live process is a member of (one its engines left behind) takes
        ``budget_bytes``, as a new one would (:meth:`claim_budget`).
        ``directory`` stands for ``KVELASTIC_SHARED_DIR``; ``lock_timeout_s``
        is the longest any call waits for another process.
        """
        _check_budget(budget_bytes)
        if not 1 <= slots <= MAX_SLOTS:
            raise BadLimits(f"an account has 1 to {MAX_SLOTS} member slots, not {slots}")
        header = Header(budget_bytes=budget_bytes, gpu_id=gpu_id, created=time.time(), slots=slots)
        account = cls(AccountFile(account_path(gpu_id, directory), create_with=header,
                                  lock_timeout_s=lock_timeout_s))
        if claim_budget:
            try:
                account.claim_budget(budget_bytes)
            except BaseException:
                account.close()
                raise
        return account

    @classmethod
    def attach(cls, path: str | Path, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> "SharedAccount":
        """Open an existing account file; never create one (raises AccountNotFound)."""
        return cls(AccountFile(Path(path), lock_timeout_s=lock_timeout_s))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "SharedAccount":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        return self._file.path

    @property
    def writable(self) -> bool:
        """False when this process may only read the file (its changes raise AccountNotWritable)."""
        return self._file.writable

    # ----------------------------------------------------------- transactions
    @contextmanager
    def _transaction(self, timeout_s: float | None = None) -> Iterator[Snapshot]:
        """The file's transaction, after freeing the slots of dead processes and lapsed leases.

        A reader that may not write the file still leaves dead members out of
        what it sees; it just cannot free their slots.
        """
        with self._file.transaction(timeout_s) as snap:
            for record in snap.used:
                if not self._alive(record, snap.now):
                    if self._file.writable:
                        snap.write(MemberRecord(slot=record.slot))
                    record.pid = 0
            yield snap

    def _alive(self, record: MemberRecord, now: float) -> bool:
        """Liveness of a record's process; a positive answer is trusted for ``ALIVE_RECHECK_S``.

        Reading ``/proc`` for every member on every grant would cost more than
        the rest of the grant; a death is still noticed within a fraction of a
        second, and this process is never checked at all. A record of another
        pid namespace lives while its lease does (:func:`lease_holds`).
        """
        if record.pid_ns != own_pid_namespace():
            return lease_holds(record, now, self.lease_s)
        key = (record.pid, record.start_time)
        if record.pid == os.getpid():
            return record.start_time in (0, own_start_time())
        now = time.monotonic()
        seen = self._seen_alive.get(key)
        if seen is not None and now - seen < ALIVE_RECHECK_S:
            return True
        if not provably_dead(record.pid_ns, *key):
            if len(self._seen_alive) > 4 * DEFAULT_SLOTS:
                self._seen_alive.clear()
            self._seen_alive[key] = now
            return True
        self._seen_alive.pop(key, None)
        return False

    # ------------------------------------------------------------------ reads
    @property
    def gpu_id(self) -> str:
        with self._transaction() as snap:
            return snap.header.gpu_id

    @property
    def budget(self) -> int:
        """The GPU's budget of physical KV bytes, shared by all members."""
        with self._transaction() as snap:
            return snap.header.budget_bytes

    def members(self) -> list[MemberInfo]:
        """Live members in join order (dead ones are pruned first)."""
        with self._transaction() as snap:
            return [MemberInfo.of(r, snap.now, self.want_ttl_s)
                    for r in sorted(snap.used, key=lambda r: (r.joined_at, r.slot))]

    def member(self, name: str) -> MemberInfo:
        """The live member called ``name`` (raises UnknownMember)."""
        with self._transaction() as snap:
            return MemberInfo.of(self._find(snap, name), snap.now, self.want_ttl_s)

    def demand(self) -> int:
        """Bytes the account currently needs its members to give back."""
        with self._transaction() as snap:
            return policy.demand(snap.records, snap.header.budget_bytes, snap.now, self.want_ttl_s)

    # ----------------------------------------------------------------- writes
    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget (members honour it on their next grant and tick)."""
        _check_budget(budget_bytes)
        with self._transaction() as snap:
            reserved = sum(r.min_bytes for r in snap.used)
            if reserved > budget_bytes:
                raise BadLimits(f"a budget of {format_size(budget_bytes)} is below what the members "
                                f"reserve ({format_size(reserved)})")
            snap.header.budget_bytes = budget_bytes
            snap.write_header()

    def claim_budget(self, budget_bytes: int) -> bool:
        """Set the budget only if no live process is a member (True if set); a live account keeps its own."""
        _check_budget(budget_bytes)
        with self._transaction() as snap:
            if snap.used:
                return snap.header.budget_bytes == budget_bytes
            snap.header.budget_bytes = budget_bytes
            snap.write_header()
            return True

    def set_limits(self, name: str, *, min_bytes: int | None = None,
                   max_bytes: int | None = None) -> MemberInfo:
        """Change a live member's reservation and/or cap (``max_bytes=0`` clears the cap).

        The member applies the new cap on its next tick by giving back what it
        holds above it; grants beyond it are refused at once. An engine that
        joined with a cap reads 0 as "my start-up cap" (see :meth:`restore_max`).
        """
        with self._transaction() as snap:
            return self._apply_limits(snap, self._find(snap, name), min_bytes, max_bytes)

    def restore_max(self, name: str, *, min_bytes: int | None = None,
                    only_if_cleared: bool = False) -> MemberInfo:
        """Put a live member's cap back to the one it joined with (its start-up cap), in one step.

        ``only_if_cleared`` leaves a cap other than 0 alone: the engine showing
        its restored cap must not undo a newer ``kvelastic limit``.
        """
        with self._transaction() as snap:
            record = self._find(snap, name)
            if only_if_cleared and record.max_bytes:
                return MemberInfo.of(record, snap.now, self.want_ttl_s)
            return self._apply_limits(snap, record, min_bytes, record.start_max_bytes)

    def _apply_limits(self, snap: Snapshot, record: MemberRecord, min_bytes: int | None,
                      max_bytes: int | None) -> MemberInfo:
        new_min = record.min_bytes if min_bytes is None else min_bytes
        new_max = record.max_bytes if max_bytes is None else max_bytes
        _check_limits(record.name, new_min, new_max)
        _check_reservations(snap, record.name, new_min)
        record.min_bytes, record.max_bytes = new_min, new_max
        snap.write(record)
        return MemberInfo.of(record, snap.now, self.want_ttl_s)

    def join(self, name: str, *, model: str = "", port: int = 0, min_bytes: int = 0,
             max_bytes: int = 0) -> "Member":
        """Become a member called ``name``; raises NameInUse if a live process holds the name.

        The name must be :data:`~kvelastic.shared.names.INSTANCE_NAME_FORM`
        (BadName otherwise): ASCII, so it fits its record's field whole.

        ``max_bytes`` is also kept as the member's start-up cap, which
        :meth:`restore_max` (``kvelastic limit NAME none``) puts back, so a
        reset never leaves an engine free to grow over the whole GPU.
        """
        if not is_instance_name(name):
            raise BadName(f"instance name {name!r} must be {INSTANCE_NAME_FORM}")
        _check_limits(name, min_bytes, max_bytes)
        pid, started, pid_ns = os.getpid(), own_start_time(), own_pid_namespace()
        with self._transaction() as snap:
            holder = snap.by_name(name)
            if holder is not None:
                raise NameInUse(f"instance name {name!r} is already used by {self._holder(holder, snap.now)} "
                                f"on this GPU; set a different KVELASTIC_NAME", name=name, pid=holder.pid)
            _check_reservations(snap, name, min_bytes)
            record = snap.free_slot()
            if record is None:
                raise AccountFull(f"all {snap.header.slots} member slots of {self.path} are in use")
            slot = record.slot
            record = MemberRecord(name=name, model=model, pid=pid, start_time=started, port=port,
                                  min_bytes=min_bytes, max_bytes=max_bytes, heartbeat=snap.now,
                                  joined_at=snap.now, start_max_bytes=max_bytes, pid_ns=pid_ns, slot=slot)
            snap.write(record)
        return Member(self, record)

    def _holder(self, record: MemberRecord, now: float) -> str:
        """Who holds a name, for NameInUse; for another pid namespace, when its lease lapses."""
        if record.pid_ns == own_pid_namespace():
            return f"live process {record.pid}"
        silent = max(0.0, now - record.heartbeat)
        return (f"process {record.pid} of another pid namespace (a container), last heard from {silent:.0f} s ago; "
                f"if that container is gone, the name is free once it has been silent for {self.lease_s:g} s")

    @staticmethod
    def _find(snap: Snapshot, name: str) -> MemberRecord:
        record = snap.by_name(name)
        if record is None:
            known = ", ".join(sorted(r.name for r in snap.used)) or "none"
            raise UnknownMember(f"no live instance called {name!r} (live: {known})", name=name)
        return record
