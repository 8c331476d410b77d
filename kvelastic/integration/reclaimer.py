"""Background upkeep of one engine's elastic KV cache.

The engine thread sleeps when there is no request, so memory that should go
back to the GPU after a burst would otherwise stay mapped. This thread wakes a
few times a second and, holding the scheduler's lock (so it never races a
scheduling step), releases groups that hold only cached prefix blocks idle for
longer than the TTL, gets the pool back under a lowered limit, finishes fenced
unmaps, and keeps a warm reserve of pages while the engine is busy.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, ContextManager

from kvelastic.integration.elastic_cache import ElasticKVCache
from kvelastic.integration.free_queue import PageAwareFreeQueue

from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")
STATS_PERIOD_S = 10.0


class Reclaimer:
    """Runs :meth:`tick` every ``interval_s`` on a daemon thread until :meth:`stop`."""

    def __init__(self, queue: PageAwareFreeQueue, cache: ElasticKVCache, lock: ContextManager,
                 *, cache_ttl_s: float, reserve_bytes: int, interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, after_tick: Callable[[], None] | None = None):
        self.queue = queue
        self.cache = cache
        self.lock = lock
        self.cache_ttl_s = cache_ttl_s
        self.reserve_pages = reserve_bytes // cache.pool.page_bytes
        self.interval_s = interval_s
        self.clock = clock
        self.after_tick = after_tick
        self.offload: Any = None
        self.link: Any = None  # the engine's membership in the GPU's shared account
        self.publisher: Any = None  # writes the snapshot behind kvelastic_* metrics
        self._last_log = 0.0
        self._last_line = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvelastic-reclaimer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - upkeep must never take the engine down
                log.exception("kvelastic: reclaimer tick failed; will retry")

    def tick(self) -> None:
        """One round of upkeep; safe to call from tests without the thread."""
        now = self.clock()
        pool = self.cache.pool
        pressure = self.link.tick(self.queue, self.offload) if self.link is not None else 0
        with self.lock:
            if pressure:  # other engines on this GPU are waiting: warm and cached memory goes first
                self.queue.set_idle()
                pool.trim_reserve(0)
                self.queue.reclaim_cached(groups_wanted=-(-pressure // max(1, self.cache.group_bytes)))
            if math.isfinite(self.cache_ttl_s):
                self.queue.reclaim_cached(idle_before=now - self.cache_ttl_s)
            busy = now - self.queue.last_allocation < max(self.cache_ttl_s, 1.0)
            if not busy:
                self.queue.set_idle()
            over = pool.stats().over_limit_bytes
            if over:
                self.queue.set_idle()  # empty groups mapped ahead go first
                pool.collect()
                over = pool.stats().over_limit_bytes
            if over:
                groups = -(-over // max(1, self.cache.group_bytes))
                self.queue.reclaim_cached(groups_wanted=groups)
        pool.collect()
        if busy:
            missing = self.reserve_pages - pool.stats().reserve_bytes // pool.page_bytes
            if missing > 0:
                pool.grow_reserve(missing)
        else:
            pool.trim_reserve(0)
        self._log_stats(now)
        if self.publisher is not None:
            self.publisher.publish(self.snapshot())
        if self.after_tick is not None:
            self.after_tick()

    def snapshot(self) -> dict[str, Any]:
        """Numbers behind the kvelastic_* metrics."""
        stats = self.cache.pool.stats()
        values: dict[str, Any] = {"mapped_bytes": stats.mapped_bytes, "held_bytes": stats.held_bytes,
                                  "limit_bytes": stats.limit_bytes or 0,
                                  "cached_bytes": self.queue.cached_groups() * self.cache.group_bytes}
        if self.offload is not None:
            values.update(self.offload.stats())
        return values

    def _log_stats(self, now: float) -> None:
        """One line every ``STATS_PERIOD_S`` while something changed: pool and host tier."""
        if now - self._last_log < STATS_PERIOD_S:
            return
        stats = self.cache.pool.stats()
        line = (f"mapped {format_size(stats.mapped_bytes)}, held {format_size(stats.held_bytes)}, "
                f"limit {format_size(stats.limit_bytes) if stats.limit_bytes else 'none'}")
        rank_held = getattr(getattr(self.cache, "mapper", None), "rank_held_bytes", None)
        if rank_held is not None:  # tensor parallelism: what each GPU really holds
            line += ", ranks hold " + " / ".join(format_size(b) for b in rank_held())
        if self.offload is not None:
            o = self.offload.stats()
            line += (f"; host tier {format_size(o['host_bytes_used'])}, hits {o['host_hits']}, misses "
                     f"{o['host_misses']}, spilled {format_size(o['spilled_bytes'])}, reloaded "
                     f"{format_size(o['reloaded_bytes'])}, ARC p {o['arc_p']}")
        if line != self._last_line:
            log.info("kvelastic: %s", line)
            self._last_line = line
        self._last_log = now
