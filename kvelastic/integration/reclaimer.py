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
from typing import Callable, ContextManager

from kvelastic.integration.elastic_cache import ElasticKVCache
from kvelastic.integration.free_queue import PageAwareFreeQueue

log = logging.getLogger("kvelastic")


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
        with self.lock:
            if math.isfinite(self.cache_ttl_s):
                self.queue.reclaim_cached(idle_before=now - self.cache_ttl_s)
            busy = now - self.queue.last_allocation < max(self.cache_ttl_s, 1.0)
            if not busy:
                self.queue.set_idle()
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
        if self.after_tick is not None:
            self.after_tick()
