"""One process's membership in a GPU's shared account.

A :class:`Member` is what the vLLM integration holds: the page source asks it
before creating physical pages and tells it after destroying them, and the
reclaimer calls :meth:`Member.tick` a few times a second to publish what it
holds and to learn its current limits and the pressure to give memory back.
Every call is one short locked transaction on the account file. When the
lock cannot be had in time (:class:`AccountBusy`), bytes already freed or
created are not lost: :meth:`Member.defer` keeps them and the next transaction
settles them first.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from kvelastic.cluster import policy
from kvelastic.cluster.errors import AccountingError, AccountNotFound, MemberGone
from kvelastic.cluster.info import MemberInfo, MemberTick
from kvelastic.cluster.records import MemberRecord
from kvelastic.cluster.storage import Snapshot

if TYPE_CHECKING:
    from kvelastic.cluster.account import SharedAccount


@dataclass(frozen=True)
class Grant:
    """The answer to :meth:`Member.request`: granted or not, why, and what was available."""

    granted: bool
    verdict: policy.Verdict
    requested_bytes: int
    available_bytes: int


class Member:
    """This process's slot in the account. Thread-safe; obtained from ``SharedAccount.join``."""

    def __init__(self, account: "SharedAccount", record: MemberRecord):
        self.account = account
        self.name = record.name
        self._slot = record.slot
        self._identity = (record.pid, record.start_time, record.pid_ns)
        self._left = False
        self._deferred = 0  # bytes created (+) or freed (-) that no transaction has recorded yet
        self._deferred_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Member({self.name!r}, pid={self._identity[0]}, account={str(self.account.path)!r})"

    @contextmanager
    def _mine(self) -> Iterator[tuple[Snapshot, MemberRecord]]:
        """The account's transaction plus this member's own record (MemberGone if it vanished).

        A member is its slot and the identity of the process that joined (pid,
        start time, pid namespace), never its name: nothing another writer does
        to the name field can make a member lose its own record. A member
        belongs to the process that joined: a forked child must join on its own.
        """
        if os.getpid() != self._identity[0]:
            raise MemberGone(f"instance {self.name!r} belongs to process {self._identity[0]}, "
                             f"not to this one ({os.getpid()})")
        with self.account._transaction() as snap:
            record = snap.records[self._slot]
            if self._left or (record.pid, record.start_time, record.pid_ns) != self._identity:
                raise MemberGone(f"instance {self.name!r} is no longer a member of {self.account.path}")
            self._settle(snap, record)
            yield snap, record

    def defer(self, nbytes: int) -> None:
        """Count ``nbytes`` (negative: freed) at the next transaction: the account was busy just now."""
        with self._deferred_lock:
            self._deferred += nbytes

    def _settle(self, snap: Snapshot, me: MemberRecord) -> None:
        with self._deferred_lock:
            delta, self._deferred = self._deferred, 0
        if delta:
            me.mapped_bytes = max(0, me.mapped_bytes + delta)
            snap.write(me)

    # ---------------------------------------------------------------- bytes
    def request(self, nbytes: int) -> Grant:
        """Ask for ``nbytes`` more; on a budget refusal the want is recorded for the others to see.

        The want holds until a grant of more bytes, or until it lapses
        (:func:`policy.wanting`); the time of the last refusal outlives a
        grant, for the fair share (:func:`policy.short_lately`). Asking for 0
        bytes (how an engine reads its headroom, every 50 ms while it
        schedules) leaves it alone: the engine still waits for what was
        refused, and clearing the want there would hide it from the others
        between two refusals. ``waiting_since`` is when the current run of
        refusals began, for ``kvelastic status``.
        """
        if nbytes < 0:
            raise AccountingError(f"{self.name!r} asked for a negative amount ({nbytes})")
        with self._mine() as (snap, me):
            budget = snap.header.budget_bytes
            verdict = policy.judge(snap.records, me, nbytes, budget)
            available = policy.headroom(snap.records, me, budget)
            me.heartbeat = snap.now
            if verdict is policy.Verdict.GRANTED and nbytes:
                me.mapped_bytes += nbytes
                me.wanted_bytes, me.waiting_since = 0, 0.0  # wanted_at stays: policy.short_lately
            elif verdict is policy.Verdict.OVER_BUDGET and nbytes:
                if not me.waiting_since or not policy.wanting(me, snap.now, self.account.want_ttl_s):
                    me.waiting_since = snap.now
                me.wanted_bytes, me.wanted_at = nbytes, snap.now
            snap.write(me)
        return Grant(verdict is policy.Verdict.GRANTED, verdict, nbytes, available)

    def want(self, nbytes: int) -> bool:
        """Record that this member needs ``nbytes`` more that the budget cannot give now; take nothing.

        How an engine's scheduler says that a request waits for memory it has
        not asked for (it does not ask while its headroom is short): the want
        creates pressure on the others exactly as a refused grant would. True
        if recorded; False if the budget has the room after all (the engine
        maps it on its next step).
        """
        if nbytes <= 0:
            raise AccountingError(f"{self.name!r} wanted a non-positive amount ({nbytes})")
        with self._mine() as (snap, me):
            if policy.judge(snap.records, me, nbytes, snap.header.budget_bytes) is not policy.Verdict.OVER_BUDGET:
                return False
            if not me.waiting_since or not policy.wanting(me, snap.now, self.account.want_ttl_s):
                me.waiting_since = snap.now
            me.wanted_bytes, me.wanted_at, me.heartbeat = nbytes, snap.now, snap.now
            snap.write(me)
            return True

    def withdraw_want(self) -> None:
        """This member needs nothing more now (its engine went to sleep): its want, and the fair share a
        recent refusal claims for it, no longer hold the others back."""
        with self._mine() as (snap, me):
            me.wanted_bytes, me.wanted_at, me.waiting_since, me.heartbeat = 0, 0.0, 0.0, snap.now
            snap.write(me)

    def acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the budget if the rules allow (see :mod:`kvelastic.cluster.policy`)."""
        return self.request(nbytes).granted

    def adopt(self, nbytes: int) -> None:
        """Count ``nbytes`` that already exist (created before joining) without asking.

        The account must show what is really on the GPU; if this takes it over
        the budget, the demand it creates makes members above their
        reservation give back cached memory.
        """
        if nbytes < 0:
            raise AccountingError(f"{self.name!r} adopted a negative amount ({nbytes})")
        with self._mine() as (snap, me):
            me.mapped_bytes += nbytes
            me.heartbeat = snap.now
            snap.write(me)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` this member held (after the physical memory is really freed)."""
        if nbytes < 0:
            raise AccountingError(f"{self.name!r} released a negative amount ({nbytes})")
        with self._mine() as (snap, me):
            if nbytes > me.mapped_bytes:
                raise AccountingError(f"{self.name!r} released {nbytes} bytes but holds {me.mapped_bytes}")
            me.mapped_bytes -= nbytes
            me.heartbeat = snap.now
            snap.write(me)

    # ----------------------------------------------------------- reporting
    def report(self, *, cached_bytes: int | None = None, host_bytes: int | None = None) -> None:
        """Publish reclaimable cached GPU bytes and host-tier bytes; also a heartbeat."""
        with self._mine() as (snap, me):
            self._publish(snap, me, cached_bytes, host_bytes)

    @staticmethod
    def _publish(snap: Snapshot, me: MemberRecord, cached_bytes: int | None, host_bytes: int | None) -> None:
        if cached_bytes is not None:
            me.cached_bytes = max(0, int(cached_bytes))
        if host_bytes is not None:
            me.host_bytes = max(0, int(host_bytes))
        me.heartbeat = snap.now
        snap.write(me)

    def pressure(self) -> int:
        """Bytes this member should give back now because others wait (policy in :mod:`.policy`)."""
        with self._mine() as (snap, me):
            return policy.pressure(snap.records, me, snap.header.budget_bytes, snap.now,
                                   self.account.want_ttl_s)

    def limits(self) -> tuple[int, int]:
        """``(min_bytes, max_bytes)`` as the file says now (others may change them; 0 = no max)."""
        with self._mine() as (_, me):
            return me.min_bytes, me.max_bytes

    def tick(self, *, cached_bytes: int | None = None, host_bytes: int | None = None) -> MemberTick:
        """One upkeep round in one transaction: publish, then read limits and pressure."""
        with self._mine() as (snap, me):
            self._publish(snap, me, cached_bytes, host_bytes)
            budget = snap.header.budget_bytes
            ttl = self.account.want_ttl_s
            push = policy.pressure(snap.records, me, budget, snap.now, ttl)
            cap = policy.share_cap(snap.records, me, budget, snap.now, ttl)
            return MemberTick(min_bytes=me.min_bytes, max_bytes=me.max_bytes, pressure_bytes=push,
                              budget_bytes=budget, share_cap_bytes=cap)

    def info(self) -> MemberInfo:
        with self._mine() as (snap, me):
            return MemberInfo.of(me, snap.now, self.account.want_ttl_s)

    # ------------------------------------------------------------- leaving
    def leave(self) -> None:
        """Free the slot (the bytes it held return to the budget). Safe to call twice."""
        if self._left:
            return
        try:
            with self._mine() as (snap, me):
                snap.write(MemberRecord(slot=me.slot))
        except (MemberGone, AccountNotFound):
            pass  # the record, or the whole account, is already gone
        self._left = True

    def __enter__(self) -> "Member":
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()
