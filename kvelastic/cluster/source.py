"""A page source that asks the GPU's shared account before creating pages.

It slots into the pool's source stack right above the device, so the account
counts every physical byte the process owns (mapped, waiting for a fence, or
kept warm in the reserve)::

    ReserveSource(LimitedSource(SharedBudgetSource(DeviceSource(backend), member)))

A refusal raises :class:`SharedBudgetExceeded`, a ``PoolExhausted``, which the
integration already turns into a scheduling miss. The grant is taken before
the pages are created and returned if creating them fails, so the account
never shows bytes that do not exist, and bytes are given back only after the
pages are destroyed, so it never shows less than exists.

The source may be built before the process has joined (``member=None``: it
only counts, so start-up warm-up is never refused); :meth:`attach` then hands
what exists to the member and gates from there on. The engine attaches a
:class:`~kvelastic.cluster.membership.Membership`, whose answer None ("no
account to ask") makes the source count without asking until it rejoins
(:meth:`rejoin`). An :attr:`~SharedBudgetSource.observer` hears of budget
refusals, of pages created on a grant and of bytes given back, which is where
reclaim latency is timed.
"""

from __future__ import annotations

from typing import Any

from kvelastic.cluster.ledger import BudgetGate, BudgetLedger, ReclaimObserver
from kvelastic.pool.sources import PageAdaptor, PageSource

__all__ = ["SharedBudgetSource", "BudgetGate", "ReclaimObserver"]


class SharedBudgetSource(PageAdaptor):
    """Gates ``upstream`` with ``member``'s grants in the shared account (the rules: :class:`BudgetLedger`)."""

    def __init__(self, upstream: PageSource, member: BudgetGate | None = None):
        super().__init__(upstream)
        self.ledger = BudgetLedger(member)

    @property
    def member(self) -> BudgetGate | None:
        return self.ledger.member

    @member.setter
    def member(self, member: BudgetGate | None) -> None:
        self.ledger.member = member

    @property
    def observer(self) -> ReclaimObserver | None:
        return self.ledger.observer

    @observer.setter
    def observer(self, observer: ReclaimObserver | None) -> None:
        self.ledger.observer = observer

    @property
    def lock(self) -> Any:
        """The lock grants and releases run under; an observer takes it for its own periodic work."""
        return self.ledger.lock

    @property
    def refusals(self) -> int:
        return self.ledger.refusals

    def attach(self, member: BudgetGate) -> None:
        """Start gating with ``member``, which adopts the bytes this source already handed out."""
        self.ledger.attach(member)

    def rejoin(self) -> bool:
        """Let a detached Membership join again, handing it what this source holds (atomically)."""
        return self.ledger.rejoin()

    def acquire(self, count: int, *, force: bool = False) -> list[Any]:
        if count <= 0:
            return []
        nbytes = count * self.page_bytes
        with self.ledger.lock:
            granted = self.ledger.charge(nbytes, force=force)
            try:
                handles = self.upstream.acquire(count)
            except BaseException:
                self.ledger.undo(nbytes)
                raise
            if granted:
                self.ledger.made(nbytes)
            return handles

    def release(self, handles: list[Any]) -> None:
        if not handles:
            return
        with self.ledger.lock:
            self.upstream.release(handles)
            self.ledger.release(len(handles) * self.page_bytes)

    @property
    def outstanding_bytes(self) -> int:
        return self.ledger.held_bytes
