"""An engine's membership that survives whatever happens to the shared account.

The account is a file other processes can lock, remove, reset or corrupt, and
the engine consults it from vLLM's scheduler thread. Nothing that happens to
it may stop the scheduler: here every call answers.

* The lock is busy past the deadline (a member stopped inside a transaction):
  a request is refused this time (a scheduling miss), bytes created or freed
  are kept by :meth:`Member.defer` and recorded by the next transaction.
* The account is lost (its file removed or replaced, corrupt, this member's
  record pruned, any error reading it): the engine logs it once, serves on its
  own limit (``request`` answers None: decide alone), and every
  ``rejoin_period_s`` tries to join again, handing the new record what it
  holds.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Callable, TypeVar

from kvelastic.cluster import policy
from kvelastic.cluster.errors import AccountBusy, BadName, NameInUse
from kvelastic.cluster.info import MemberTick
from kvelastic.cluster.member import Grant, Member
from kvelastic.errors import KvelasticError

log = logging.getLogger("kvelastic")

REJOIN_PERIOD_S = 1.0
#: What reading or writing a shared file can raise besides kvelastic's own errors.
ACCOUNT_ERRORS = (KvelasticError, OSError, struct.error, ValueError)
T = TypeVar("T")


class Membership:
    """One engine's place in its GPU's account; no method raises because of the account.

    ``connect()`` opens the account and joins it, returning the new
    :class:`Member` (it may raise anything). The first connection is made
    here: its error is raised when it is one the user must fix (``NameInUse``,
    ``BadName``); any other leaves the membership detached, to be retried.
    """

    def __init__(self, name: str, connect: Callable[[], Member], *,
                 rejoin_period_s: float = REJOIN_PERIOD_S, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self._connect = connect
        self.rejoin_period_s = rejoin_period_s
        self._clock = clock
        self.member: Member | None = None
        self._next_try = 0.0
        self._last_problem = ""
        try:
            self.member = connect()
        except (NameInUse, BadName):
            raise
        except ACCOUNT_ERRORS as error:
            self._next_try = self._clock() + self.rejoin_period_s
            self._report(f"could not join the shared KV account ({type(error).__name__}: {error}); serving "
                         f"on its own limit until it can")

    @property
    def attached(self) -> bool:
        return self.member is not None

    @property
    def where(self) -> str:
        return str(self.member.account.path) if self.member is not None else "(no account)"

    # ------------------------------------------------------------- grants
    def request(self, nbytes: int) -> Grant | None:
        """The account's answer; a refusal when it is busy; None when there is no account to ask."""
        return self._ask(lambda m: m.request(nbytes), busy=Grant(False, policy.Verdict.BUSY, nbytes, 0), gone=None)

    def want(self, nbytes: int) -> bool:
        """The member's :meth:`~kvelastic.cluster.member.Member.want`; False when busy or without an account."""
        return self._ask(lambda m: m.want(nbytes), busy=False, gone=False)

    def withdraw_want(self) -> bool:
        """The member's :meth:`~kvelastic.cluster.member.Member.withdraw_want`; False when busy or without
        an account."""
        return self._ask(lambda m: m.withdraw_want() or True, busy=False, gone=False)

    def _ask(self, question: Callable[[Member], T], *, busy: T, gone: T) -> T:
        """``question`` put to the member: ``busy`` if the lock stayed taken, ``gone`` without an account."""
        member = self.member
        if member is None:
            return gone
        try:
            return question(member)
        except AccountBusy:
            return busy
        except ACCOUNT_ERRORS as error:
            self._lost(member, error)
            return gone

    def adopt(self, nbytes: int) -> None:
        self._count(nbytes, lambda m: m.adopt(nbytes))

    def release(self, nbytes: int) -> None:
        self._count(-nbytes, lambda m: m.release(nbytes))

    def _count(self, delta: int, record: Callable[[Member], None]) -> None:
        member = self.member
        if member is None:
            return  # a rejoin hands the new record what is held then
        try:
            record(member)
        except AccountBusy:
            member.defer(delta)
        except ACCOUNT_ERRORS as error:
            self._lost(member, error)

    # -------------------------------------------------------------- upkeep
    def tick(self, *, cached_bytes: int | None = None, host_bytes: int | None = None) -> MemberTick | None:
        """The member's tick, or None (busy, or no account: the caller keeps its own limit)."""
        member = self.member
        if member is None:
            return None
        try:
            return member.tick(cached_bytes=cached_bytes, host_bytes=host_bytes)
        except AccountBusy:
            return None
        except ACCOUNT_ERRORS as error:
            self._lost(member, error)
            return None

    def rejoin(self, held_bytes: int) -> bool:
        """Join again (at most every ``rejoin_period_s``) and adopt ``held_bytes``; True once attached.

        The caller must keep ``held_bytes`` from changing meanwhile (the page
        source calls this under its lock).
        """
        if self.member is not None:
            return True
        now = self._clock()
        if now < self._next_try:
            return False
        self._next_try = now + self.rejoin_period_s
        try:
            member = self._connect()
        except ACCOUNT_ERRORS as error:
            self._report(f"could not rejoin the shared account ({error}); still serving on its own limit")
            return False
        member.defer(held_bytes)
        self.member = member
        self._last_problem = ""
        log.warning("kvelastic: %s rejoined the shared KV account %s holding %d bytes", self.name,
                    member.account.path, held_bytes)
        return True

    def leave(self) -> None:
        member, self.member = self.member, None
        if member is None:
            return
        try:
            member.leave()
            member.account.close()
        except ACCOUNT_ERRORS:
            pass  # a record left behind is pruned once this process is gone

    # ------------------------------------------------------------ helpers
    def _lost(self, member: Member, error: BaseException) -> None:
        """``member`` failed: drop it (unless a rejoin already replaced it), free its slot if it still can."""
        if self.member is not member:
            return
        self.member = None
        self._next_try = self._clock() + self.rejoin_period_s
        try:
            member.leave()  # a record still there would hold the name against the rejoin
        except ACCOUNT_ERRORS:
            pass
        try:
            member.account.close()
        except ACCOUNT_ERRORS:
            pass
        self._report(f"lost the shared KV account ({type(error).__name__}: {error}); serving on its own "
                     f"limit until it can rejoin")

    def _report(self, problem: str) -> None:
        """Log a problem once, not on every tick while it lasts."""
        if problem != self._last_problem:
            self._last_problem = problem
            log.warning("kvelastic: %s %s", self.name, problem)
