"""Giving an engine's idle or unwanted KV memory back, a few times a second.

The engine thread sleeps when there is no request, so memory that should go
back to the GPU after a burst would otherwise stay mapped. These are the
upkeep thread's memory jobs (:mod:`kvelastic.scheduler.upkeep` runs them):

- :class:`AccountSync` reports to the GPU's shared account, applies the limit
  it holds for this engine and learns how many bytes other engines wait for;
- :class:`CacheReclaim`, under the scheduler's lock (so it never races a
  scheduling step), releases groups that hold only cached prefix blocks when
  they idle past the TTL, when the pool is over a lowered limit, or when other
  engines wait, and drops the empty groups mapped ahead once the engine idles;
  what is still over the limit after that is held by running requests, and the
  free-block count stops offering it until they have given it back;
- :class:`WarmReserve` finishes fenced unmaps and keeps a warm reserve of pages
  while the engine is busy, none while it idles; the pool parks those pages at
  the groups the scheduler maps next, so that mapping costs no driver call.
  With a host tier the reserve also grows, while nobody else waits, to cover
  the longest host-tier run reloaded lately
  (:mod:`~kvelastic.scheduler.reload_reserve`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from kvelastic.pool.reserve_growth import grow_in_chunks
from kvelastic.roles import SchedulerCache

if TYPE_CHECKING:
    from kvelastic.roles import AccountLink
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.scheduler.reload_reserve import ReloadReserve


class OffloadStatistics(Protocol):
    """The host tier's numbers (``host_bytes_used``, hits, bytes moved, ...)."""

    def stats(self) -> dict[str, Any]: ...


def recently_busy(queue: "PageAwareFreeQueue", now: float, cache_ttl_s: float) -> bool:
    """Whether the engine allocated blocks within the TTL (and at least the last second)."""
    return now - queue.last_allocation < max(cache_ttl_s, 1.0)


def groups_for(nbytes: int, cache: SchedulerCache) -> int:
    """Page groups that make up ``nbytes``, rounded up."""
    return -(-nbytes // max(1, cache.group_bytes))


class AccountSync:
    """Keeps this engine and the GPU's shared account in step; remembers the pressure it read."""

    under_scheduler_lock = False

    def __init__(self, link: "AccountLink", queue: "PageAwareFreeQueue", offload: OffloadStatistics | None):
        self.link = link
        self.queue = queue
        self.offload = offload
        self.pressure_bytes = 0  # what other engines on this GPU wait for, as of the last run

    def run(self, now: float) -> None:
        self.pressure_bytes = self.link.tick(self.queue, self.offload)


class CacheReclaim:
    """Releases cached and mapped-ahead groups that idle, exceed the limit, or others need."""

    under_scheduler_lock = True

    def __init__(self, queue: "PageAwareFreeQueue", cache: SchedulerCache, *, cache_ttl_s: float,
                 account: AccountSync | None = None):
        self.queue = queue
        self.cache = cache
        self.cache_ttl_s = cache_ttl_s
        self.account = account

    def run(self, now: float) -> None:
        queue, pool = self.queue, self.cache.pool
        pressure = self.account.pressure_bytes if self.account is not None else 0
        if pressure:  # other engines on this GPU are waiting: warm and cached memory goes first
            queue.set_idle()
            pool.trim_reserve(0)
            queue.reclaim_cached(groups_wanted=groups_for(pressure, self.cache))
        if math.isfinite(self.cache_ttl_s):
            queue.reclaim_cached(idle_before=now - self.cache_ttl_s)
        if not recently_busy(queue, now, self.cache_ttl_s):
            queue.set_idle()
        over = pool.stats().over_limit_bytes
        if over:
            queue.set_idle()  # empty groups mapped ahead go first
            pool.collect()
            over = pool.stats().over_limit_bytes
        if over:
            queue.reclaim_cached(groups_wanted=groups_for(over, self.cache))
            over = pool.stats().over_limit_bytes
        # What is still over the limit is held by running requests: stop offering it (see shrink_by).
        queue.shrink_by(groups_for(over, self.cache))


#: A block allocated this recently means requests are running: the reserve grows ``busy_step_bytes`` a tick.
PACED_WITHIN_S = 0.25
#: The most the warm reserve grows per tick while requests run. On an H200 2 GiB grown at once beside the
#: request after a 16k-token reload cost that request 15-40 ms in a third of the reps; 256 MiB a tick, none.
BUSY_STEP_BYTES = 256 * 1024 * 1024


class WarmReserve:
    """Finishes fenced unmaps, then keeps ``reserve_pages`` warm while busy and none while idle.

    The reserve only grows within the room the device and the shared account
    give now: a page asked for ahead of need and refused would be recorded as
    a want, and a waiting engine is spared by the others' pressure, so an
    engine whose requests are done would keep its cache from the engines that
    really wait (seen on the GPU: 8 MiB wants renewed for 15 s after a burst).

    ``reloads`` raises the target to cover
    the longest host-tier run reloaded lately, but only while no other engine
    waits (``account``'s pressure): that part is memory held for a reload that
    may come, so it is the first to go. When the target falls (the runs aged
    out, or others began to wait) the reserve is trimmed to it at once.

    It grows a page group per pool call (:func:`~kvelastic.pool.reserve_growth.grow_in_chunks`), and
    not while the mapper has maps queued or running: each call holds the pool's lock, and a map may be
    what the scheduler waits for (a reload's own groups on an idle engine, the next request's first
    group after a reload used the reserve). What it did not grow, the next tick does. While requests
    run (a block allocated within :data:`PACED_WITHIN_S`) it grows ``busy_step_bytes`` a tick
    (:data:`BUSY_STEP_BYTES`): growth at once beside a request cost it time although no engine thread
    waited for the pool's lock (its driver calls beside the engine's launches, not established which
    part); between requests it grows at once.
    """

    under_scheduler_lock = False

    def __init__(self, queue: "PageAwareFreeQueue", cache: SchedulerCache, *, reserve_pages: int,
                 cache_ttl_s: float, reloads: "ReloadReserve | None" = None, account: AccountSync | None = None,
                 busy_step_bytes: int = BUSY_STEP_BYTES):
        self.queue = queue
        self.cache = cache
        self.reserve_pages = reserve_pages
        self.cache_ttl_s = cache_ttl_s
        self.reloads = reloads
        self.account = account
        self._last_target = reserve_pages
        self.busy_step_bytes = busy_step_bytes

    def target_pages(self, now: float) -> int:
        """Pages to keep warm while busy: ``reserve_pages``, or enough for a recent host run if more."""
        if self.reloads is None or (self.account is not None and self.account.pressure_bytes):
            return self.reserve_pages
        page = self.cache.pool.page_bytes
        return max(self.reserve_pages, -(-self.reloads.bytes_wanted(now) // page))

    def run(self, now: float) -> None:
        pool = self.cache.pool
        pool.collect()
        if not recently_busy(self.queue, now, self.cache_ttl_s):
            pool.trim_reserve(0)
            self._last_target = self.reserve_pages
            return
        target = self.target_pages(now)
        if target < self._last_target:  # what covered a reload is not wanted any more: give it back now
            pool.trim_reserve(target)
        self._last_target = target
        warm = pool.stats().reserve_bytes
        missing = target - warm // pool.page_bytes
        room = pool.headroom_estimate(self.cache.device_room())  # counts the warm pages too
        if room is not None:
            missing = min(missing, (room - warm) // pool.page_bytes)
        if now - self.queue.last_allocation < PACED_WITHIN_S:  # requests are running: a step a tick
            missing = min(missing, max(1, self.busy_step_bytes // pool.page_bytes))
        # which also parks warm pages at the groups mapped next; no chunk while maps are queued
        grow_in_chunks(pool, max(0, missing), wait_for=self.queue.mapper.busy)
