"""The bytes one engine holds on a GPU, kept in step with its member record in the GPU's shared account.

Two callers create KV memory and must ask the account first: the page source
stack of a pool in this process (:class:`~kvelastic.cluster.source.SharedBudgetSource`,
which charges before it creates pages) and the scheduler of an engine whose
pages live in worker ranks' processes (:class:`~kvelastic.tp.remote_mapper.RemoteMapper`,
which charges before it sends a map command). Both keep their bytes here, so the
rules are written once: bytes are charged before memory exists and given back
only once it is gone (or can no longer be used); before the engine joins
(``member=None``) and while its account is lost (the member answers None) bytes
are only counted, so start-up is never refused; :meth:`attach` and
:meth:`rejoin` hand the member what is held at that moment, atomically.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from kvelastic.cluster.errors import SharedBudgetExceeded
from kvelastic.cluster.member import Grant
from kvelastic.cluster.policy import Verdict
from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")


class BudgetGate(Protocol):
    """What the ledger asks: a :class:`~kvelastic.cluster.member.Member`, or an engine's Membership."""

    name: str

    def request(self, nbytes: int) -> Grant | None: ...

    def adopt(self, nbytes: int) -> None: ...

    def release(self, nbytes: int) -> None: ...


class ReclaimObserver(Protocol):
    """Told, under the ledger's lock, what reclaim timing needs (:mod:`kvelastic.scheduler.reclaim_timing`)."""

    def refused(self, nbytes: int) -> None:
        """The shared budget refused ``nbytes``."""

    def created(self, nbytes: int) -> None:
        """Memory of ``nbytes`` was granted and made."""

    def released(self, nbytes: int) -> None:
        """``nbytes`` went back to the account."""


class BudgetLedger:
    """Charges and releases bytes against ``member``'s grants; counts only while there is no member."""

    def __init__(self, member: BudgetGate | None = None):
        self.member = member
        self.observer: ReclaimObserver | None = None  # must never raise: it is called where memory is made
        self.refusals = 0
        self._held = 0
        self._lock = threading.RLock()  # keeps attach() atomic with respect to charge/release

    @property
    def lock(self) -> threading.RLock:
        """The lock grants and releases run under; an observer takes it for its own periodic work."""
        return self._lock

    @property
    def held_bytes(self) -> int:
        return self._held

    def attach(self, member: BudgetGate) -> None:
        """Start gating with ``member``, which adopts the bytes held now."""
        with self._lock:
            if self.member is not None:
                raise ValueError(f"already attached to {self.member!r}")
            member.adopt(self._held)
            self.member = member

    def rejoin(self) -> bool:
        """Let a detached Membership join again, handing it what is held now (atomically)."""
        with self._lock:
            return self.member.rejoin(self._held)  # type: ignore[union-attr]

    def charge(self, nbytes: int, *, force: bool = False) -> bool:
        """Count ``nbytes`` about to be made; SharedBudgetExceeded if the account refuses them.

        ``force``: counted, never asked (the account must show what exists).
        True if the account granted them: call :meth:`made` once they exist.
        """
        if nbytes <= 0:
            return False
        with self._lock:
            member = self.member
            grant = None if member is None or force else member.request(nbytes)
            if grant is not None and not grant.granted:
                self.refusals += 1
                if self.observer is not None and grant.verdict is Verdict.OVER_BUDGET:
                    self.observer.refused(nbytes)
                raise SharedBudgetExceeded(
                    f"instance {member.name!r} may not map {format_size(nbytes)} more: "  # type: ignore[union-attr]
                    f"{grant.verdict.value} ({format_size(grant.available_bytes)} available to it)",
                    requested_bytes=nbytes, available_bytes=grant.available_bytes)
            self._held += nbytes
            if member is not None and force:
                member.adopt(nbytes)
            return grant is not None

    def made(self, nbytes: int) -> None:
        """Granted bytes now exist (reclaim timing measures from here)."""
        with self._lock:
            if self.observer is not None:
                self.observer.created(nbytes)

    def release(self, nbytes: int) -> None:
        """``nbytes`` are gone: back to the account. Never fails the caller (the memory is gone anyway)."""
        if nbytes <= 0:
            return
        with self._lock:
            self._held -= nbytes
            self._give_back(nbytes)
            if self.observer is not None:
                self.observer.released(nbytes)

    def undo(self, nbytes: int) -> None:
        """A charge whose memory was never made after all: back to the account, no observer told."""
        with self._lock:
            self._held -= nbytes
            self._give_back(nbytes)

    def _give_back(self, nbytes: int) -> None:
        if self.member is None:
            return
        try:
            self.member.release(nbytes)
        except Exception:  # noqa: BLE001 - the memory is gone whatever the account says
            log.warning("kvelastic: could not return %s to the shared account (%r)",
                        format_size(nbytes), self.member, exc_info=True)
