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

import logging
import threading
from typing import Any, Protocol

from kvelastic.cluster.errors import SharedBudgetExceeded
from kvelastic.cluster.member import Grant
from kvelastic.cluster.policy import Verdict
from kvelastic.pool.sources import PageAdaptor, PageSource
from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")


class BudgetGate(Protocol):
    """What the source asks: a :class:`~kvelastic.cluster.member.Member`, or an engine's Membership."""

    name: str

    def request(self, nbytes: int) -> Grant | None: ...

    def adopt(self, nbytes: int) -> None: ...

    def release(self, nbytes: int) -> None: ...


class ReclaimObserver(Protocol):
    """Told, under the source's lock, what reclaim timing needs (:mod:`kvelastic.scheduler.reclaim_timing`)."""

    def refused(self, nbytes: int) -> None:
        """The shared budget refused ``nbytes``."""

    def created(self, nbytes: int) -> None:
        """The pages of a granted request of ``nbytes`` were created."""

    def released(self, nbytes: int) -> None:
        """``nbytes`` of destroyed pages went back to the account."""


class SharedBudgetSource(PageAdaptor):
    """Gates ``upstream`` with ``member``'s grants in the shared account."""

    def __init__(self, upstream: PageSource, member: BudgetGate | None = None):
        super().__init__(upstream)
        self.member = member
        self._outstanding = 0
        self.refusals = 0
        self.observer: ReclaimObserver | None = None  # must never raise: it is called where pages are created
        self._lock = threading.RLock()  # keeps attach() atomic with respect to acquire/release

    @property
    def lock(self) -> threading.RLock:
        """The lock grants and releases run under; an observer takes it for its own periodic work."""
        return self._lock

    def attach(self, member: BudgetGate) -> None:
        """Start gating with ``member``, which adopts the bytes this source already handed out."""
        with self._lock:
            if self.member is not None:
                raise ValueError(f"already attached to {self.member!r}")
            member.adopt(self._outstanding)
            self.member = member

    def rejoin(self) -> bool:
        """Let a detached Membership join again, handing it what this source holds (atomically)."""
        with self._lock:
            return self.member.rejoin(self._outstanding)  # type: ignore[union-attr]

    def acquire(self, count: int, *, force: bool = False) -> list[Any]:
        if count <= 0:
            return []
        with self._lock:
            return self._acquire(count, force)

    def _acquire(self, count: int, force: bool) -> list[Any]:
        nbytes = count * self.page_bytes
        if self.member is None or force:
            handles = self.upstream.acquire(count)
            self._outstanding += nbytes
            if self.member is not None:
                self.member.adopt(nbytes)  # counted, not asked: the account must show what exists
            return handles
        grant = self.member.request(nbytes)
        if grant is None:  # no account to ask right now: count, as before joining
            handles = self.upstream.acquire(count)
            self._outstanding += nbytes
            return handles
        if not grant.granted:
            self.refusals += 1
            if self.observer is not None and grant.verdict is Verdict.OVER_BUDGET:
                self.observer.refused(nbytes)
            raise SharedBudgetExceeded(
                f"instance {self.member.name!r} may not map {format_size(nbytes)} more: "
                f"{grant.verdict.value} ({format_size(grant.available_bytes)} available to it)",
                requested_bytes=nbytes, available_bytes=grant.available_bytes)
        try:
            handles = self.upstream.acquire(count)
        except BaseException:
            self._give_back(nbytes)
            raise
        self._outstanding += nbytes
        if self.observer is not None:
            self.observer.created(nbytes)
        return handles

    def release(self, handles: list[Any]) -> None:
        if not handles:
            return
        with self._lock:
            self.upstream.release(handles)
            nbytes = len(handles) * self.page_bytes
            self._outstanding -= nbytes
            self._give_back(nbytes)
            if self.observer is not None:
                self.observer.released(nbytes)

    def _give_back(self, nbytes: int) -> None:
        """Return bytes to the account; the memory is already gone, so never fail the caller."""
        if self.member is None:
            return
        try:
            self.member.release(nbytes)
        except Exception:  # noqa: BLE001 - the pages are gone whatever the account says
            log.warning("kvelastic: could not return %s to the shared account (%r)",
                        format_size(nbytes), self.member, exc_info=True)

    @property
    def outstanding_bytes(self) -> int:
        return self._outstanding
