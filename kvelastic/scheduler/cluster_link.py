"""One engine's membership in its GPU's shared KV account.

Joined when the scheduler attaches (after start-up warm-up, which must never be
refused); from then on every physical page the engine creates is granted by
the account. Each reclaimer tick reports what the engine holds, picks up
limits changed at run time (``kvelastic limit NAME 8GiB``) and gives memory
back when other engines on the GPU are waiting for it.

The account is consulted from vLLM's scheduler thread (the free-block count
asks for headroom every 50 ms), so every call goes through a
:class:`~kvelastic.cluster.membership.Membership`: a lock held by another
process past ``LOCK_TIMEOUT_S`` is no headroom this tick, and a lost account
(removed, reset, corrupt, this engine's record gone) leaves the engine serving
on its own limit until it rejoins.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from kvelastic.cluster.account import SharedAccount
from kvelastic.cluster.device import device_identity
from kvelastic.cluster.errors import AccountBusy
from kvelastic.cluster.ledger import BudgetLedger
from kvelastic.cluster.member import Member
from kvelastic.cluster.membership import ACCOUNT_ERRORS, Membership
from kvelastic.cluster.source import SharedBudgetSource
from kvelastic.errors import ConfigError
from kvelastic.roles import SchedulerCache
from kvelastic.scheduler.reclaim_timing import ReclaimTiming
from kvelastic.shared.names import derived_instance_name
from kvelastic.shared.scope import current_scope, other_scopes
from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")

LOCK_TIMEOUT_S = 0.005  # the longest the scheduler's thread waits for another process
WANT_PERIOD_S = 0.05  # the scheduler tells the account of its waiting requests at most this often


def gpu_identity(cache: SchedulerCache) -> tuple[str, int | None]:
    """A name for the device's account file, and its total memory when known (a pool in this process)."""
    return device_identity(cache.pool.backend)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MemberTerms:
    """What an engine joins its GPU's account with, as its settings and its model say."""

    name: str | None = None  # None: ``<model folder>-<port or pid>``
    model: str = ""
    port: int = 0
    min_bytes: int = 0  # KVELASTIC_MIN: what the account keeps for this engine
    shared_budget_bytes: int | None = None  # KVELASTIC_SHARED_BUDGET: the budget of an account it creates


def default_name(terms: MemberTerms) -> str:
    """``<model folder>-<port or pid>``, made a valid instance name whatever the folder is called."""
    return derived_instance_name(os.path.basename(terms.model.rstrip("/")), terms.port or os.getpid(), "vllm")


def _warn_about_uncounted_engines() -> None:
    """Engines this account cannot count, other users' (or groups'): say so, never silently."""
    try:
        scope = current_scope()
    except ConfigError:
        return
    others = other_scopes(scope)
    if others:
        log.warning("kvelastic: this GPU account is shared by %s only; %s in %s hold(s) other users' kvelastic "
                    "files, whose engines are not counted in it (docs/security.md; KVELASTIC_SHARED_GROUP lets "
                    "a group share one account)", scope.describe(), ", ".join(others), scope.root)


def join_shared_account(cache: SchedulerCache, source: "SharedBudgetSource | BudgetLedger", terms: MemberTerms,
                        limit_bytes: int | None,
                        device: tuple[str, int | None] | None = None, **options: Any) -> "ClusterLink | None":
    """The engine's membership in its device's account, or None (with a warning) where joining failed.

    Sharing is an addition: an engine that cannot join serves on its own limit.
    Two live engines with one name are a configuration error the user must fix.
    ``options``: :class:`ClusterLink`'s ``group_bytes`` and ``install``.
    """
    from kvelastic.cluster.errors import NameInUse

    try:
        return ClusterLink(cache, source, terms, limit_bytes, device, **options)
    except NameInUse:
        raise
    except Exception as exc:  # noqa: BLE001 - sharing is an addition; serving must not depend on it
        log.warning("kvelastic: could not join this GPU's shared KV account (%s); this engine runs "
                    "with its own limit only", exc)
        return None


class ClusterLink:
    """Joins the account, gates the pool with it, and keeps the two in step."""

    def __init__(self, cache: SchedulerCache, source: "SharedBudgetSource | BudgetLedger", terms: MemberTerms,
                 limit_bytes: int | None, device: tuple[str, int | None] | None = None,
                 group_bytes: int | None = None, install: bool = True):
        """``source``: what counts this engine's bytes on the device (its pool's budget layer, or the
        ledger of a worker rank's pages); ``device``: the account's id and the device's total memory,
        where the pool is not in this process; ``group_bytes``: a page group's bytes on this device
        (the cache's unless its ranks differ); ``install``: gate the cache with this account (False
        where a :class:`~kvelastic.scheduler.link_group.LinkGroup` gates it with several)."""
        self.gpu_id, total = device if device is not None else gpu_identity(cache)
        self.budget = terms.shared_budget_bytes or total or 1 << 62
        self.terms = terms
        self.name = terms.name or default_name(terms)
        self.base_limit = limit_bytes or None  # the start-up cap: vLLM's profiled KV bytes or KVELASTIC_LIMIT
        self._restore_tried = False  # wrote the start-up cap back over the account's current 0
        self._account_limit = self.base_limit  # the pool's limit as the account's max sets it
        self._share_cap = 0  # the fair-share cap in force (0: none), see kvelastic.cluster.policy.share_cap
        self._claim_budget = bool(terms.shared_budget_bytes)  # on the first join only, never on a rejoin
        self.membership = Membership(self.name, self._connect)
        self.timing = ReclaimTiming(self.name, source.lock)
        source.observer = self.timing
        source.attach(self.membership)
        self.group_bytes = group_bytes or cache.group_bytes
        if install:
            cache.external_headroom = self.headroom
            cache.external_want = self.want
        self._next_want = 0.0
        self.source = source
        self.cache = cache
        atexit.register(self.leave)
        if self.membership.attached:
            log.info("kvelastic: joined the shared KV account of %s as %r", self.gpu_id, self.name)
        _warn_about_uncounted_engines()

    def _connect(self) -> Member:
        """Open (or create) the GPU's account and join it on this engine's terms."""
        account = SharedAccount.open(self.gpu_id, self.budget, claim_budget=self._claim_budget,
                                     lock_timeout_s=LOCK_TIMEOUT_S)
        try:
            member = account.join(self.name, model=self.terms.model, port=self.terms.port,
                                  min_bytes=self.terms.min_bytes, max_bytes=self.base_limit or 0)
        except BaseException:
            account.close()
            raise
        if self._claim_budget:
            self._claim_budget = False  # a budget changed with `kvelastic budget` since must survive a rejoin
            self._say_budget_kept(account)
        return member

    def _say_budget_kept(self, account: SharedAccount) -> None:
        """Warn when KVELASTIC_SHARED_BUDGET was not applied: the engines running keep the budget they count on."""
        try:
            budget = account.budget
        except ACCOUNT_ERRORS:
            return
        if budget != self.budget:
            log.warning("kvelastic: KVELASTIC_SHARED_BUDGET=%s is not applied: the account of %s has live members, "
                        "which keep its budget of %s; `kvelastic budget SIZE --gpu %s` changes it",
                        format_size(self.budget), self.gpu_id, format_size(budget), self.gpu_id)

    @property
    def account(self) -> SharedAccount | None:
        """The account this engine is a member of now (None while it serves on its own limit)."""
        member = self.membership.member
        return member.account if member is not None else None

    @property
    def member(self) -> Member | None:
        return self.membership.member

    def headroom(self) -> int | None:
        """Bytes the account would still grant this engine (asked at most every 50 ms); None: no account."""
        grant = self.membership.request(0)
        return None if grant is None else grant.available_bytes

    def want(self, nbytes: int) -> None:
        """The scheduler has requests waiting for ``nbytes`` the budget does not give: tell the others.

        Asked on vLLM's scheduler thread for each allocation that does not fit,
        so at most every ``WANT_PERIOD_S``; the lock is waited for 5 ms at most.
        """
        now = time.monotonic()
        if now < self._next_want or self._share_cap:
            return  # held to its fair share, this engine's shortfall is its own: nobody else can help
        self._next_want = now + WANT_PERIOD_S
        if self.membership.want(nbytes):
            with self.source.lock:
                self.timing.refused(nbytes)

    def withdraw_want(self) -> bool:
        """The engine went to sleep: it wants nothing, and claims no share it was short of lately (the
        lock is waited for 5 ms at most; False where the account was busy or absent)."""
        return self.membership.withdraw_want()

    def tick(self, queue: Any, offload: Any) -> int:
        """Report, apply the current limit; return the bytes other engines want back from us."""
        limit, pressure = self.assess(queue, offload)
        pool = self.cache.pool
        if limit != pool.stats().limit_bytes:
            pool.set_limit(limit)
        return pressure

    def assess(self, queue: Any, offload: Any) -> tuple[int | None, int]:
        """Report to the account; the pool's limit from now on, and the bytes other engines want back.

        Serving alone (no account), the limit it started with; while the
        account is busy, the limit it has.
        """
        stats = self.cache.pool.stats()
        if not self.membership.attached and not self.source.rejoin():
            self._share_cap = 0
            return self.base_limit, 0
        cached = queue.cached_groups() * self.group_bytes + stats.reserve_bytes
        host = offload.stats()["host_bytes_used"] if offload is not None else None
        t = self.membership.tick(cached_bytes=cached, host_bytes=host)
        if t is None:
            return stats.limit_bytes, 0  # busy this time, or just lost: the next tick tells
        limit = self.limit_for(t.max_bytes)
        if limit != self._account_limit:
            self._account_limit = limit
            log.info("kvelastic: %s limit now %s", self.name, format_size(limit) if limit else "none")
        effective = self._within_share(limit, t.share_cap_bytes, stats.held_bytes)
        asked = t.pressure_bytes  # what others want back: cached memory, and what the fair share caps
        if t.share_cap_bytes:
            asked = max(asked, stats.held_bytes - t.share_cap_bytes)
        self.timing.tick(asked)
        if t.max_bytes:
            self._restore_tried = False
        elif self.base_limit and not self._restore_tried:
            self._restore_tried = True  # once per change to 0: a refusal must not repeat every tick
            self._show_restored_cap()
        return effective, t.pressure_bytes

    def _within_share(self, limit: int | None, cap: int, held: int) -> int | None:
        """The pool's limit: the account's, lowered to the fair share while another engine waits below its own.

        Logged when a cap begins and when it lifts (not on every tick it holds).
        """
        if cap and cap != self._share_cap:
            log.info("kvelastic: %s holds %s, at or above its fair share of %s, while another engine waits below "
                     "its own: held to it (new requests wait; vLLM preempts what does not fit)", self.name,
                     format_size(held), format_size(cap))
        elif not cap and self._share_cap:
            log.info("kvelastic: %s may grow past its fair share again (no engine waits below its own)", self.name)
        self._share_cap = cap
        if not cap:
            return limit
        return cap if limit is None else min(limit, cap)

    def limit_for(self, max_bytes: int) -> int | None:
        """The pool limit for the account's ``max_bytes``: 0 means the start-up cap, never none.

        vLLM sized this engine (weights, activations, CUDA graphs) around its
        profiled KV bytes; an engine that started capped must not silently grow
        over the whole GPU because someone cleared its cap in the account.
        """
        return max_bytes or self.base_limit

    def _show_restored_cap(self) -> None:
        """Write the start-up cap back where the account says 0, so ``kvelastic status`` shows what holds.

        Only a writer other than ``kvelastic limit`` (which restores the cap
        itself) leaves 0 there. Never raises: the pool holds the cap either way.
        """
        account = self.account
        if account is None:
            return
        try:
            account.restore_max(self.name, only_if_cleared=True)
        except AccountBusy:
            self._restore_tried = False  # try again next tick
        except ACCOUNT_ERRORS as error:  # e.g. a min raised above the start-up cap meanwhile
            log.warning("kvelastic: %s keeps its start-up cap %s but could not show it in the account: %s",
                        self.name, format_size(self.base_limit or 0), error)

    def leave(self) -> None:
        if self.cache.external_headroom == self.headroom:  # not where a LinkGroup gates the cache
            self.cache.external_headroom = None
            self.cache.external_want = None
        self.source.member = None  # pages freed after leaving are no longer the account's business
        self.membership.leave()
