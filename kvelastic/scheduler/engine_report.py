"""What an engine tells the outside about its KV memory: a periodic log line and the metrics snapshot.

Both are jobs of the upkeep thread (:mod:`kvelastic.scheduler.upkeep`) and
read the same numbers: the pool's statistics, the cached groups, and the host
tier's counters where there is one; the snapshot also carries the engine's
reclaim timing where it shares a GPU's account.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from kvelastic.scheduler.reclaimer import OffloadStatistics
from kvelastic.roles import SchedulerCache
from kvelastic.units import format_size

if TYPE_CHECKING:
    from kvelastic.pool.lock_waits import LockWaits
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.metrics.metrics import StatsPublisher
    from kvelastic.scheduler.reclaim_timing import ReclaimTiming

log = logging.getLogger("vllm.kvelastic")
STATS_PERIOD_S = 10.0


class StatsLog:
    """One log line every ``period_s`` while something changed: pool, ranks and host tier."""

    under_scheduler_lock = False

    def __init__(self, cache: SchedulerCache, offload: OffloadStatistics | None = None, *,
                 rank_held_bytes: Callable[[], list[int]] | None = None, period_s: float = STATS_PERIOD_S):
        """``rank_held_bytes``: under tensor parallelism, what each GPU really holds."""
        self.cache = cache
        self.offload = offload
        self.rank_held_bytes = rank_held_bytes
        self.period_s = period_s
        self._last_log = 0.0
        self._last_line = ""
        self._lock_events_shown = float("-inf")  # the pool lock's long holds and waits up to here are logged
        self._lock_events_in_line = self._lock_events_shown  # ... and up to here are in the last line built

    def run(self, now: float) -> None:
        if now - self._last_log < self.period_s:
            return
        line = self.line()
        if line != self._last_line:
            log.info("kvelastic: %s", line)
            self._last_line = line
            self._lock_events_shown = self._lock_events_in_line
        self._last_log = now

    def line(self) -> str:
        stats = self.cache.pool.stats()
        line = (f"mapped {format_size(stats.mapped_bytes)}, held {format_size(stats.held_bytes)}, "
                f"limit {format_size(stats.limit_bytes) if stats.limit_bytes else 'none'}")
        if self.rank_held_bytes is not None:
            line += ", ranks hold " + " / ".join(format_size(b) for b in self.rank_held_bytes())
        waits = self.cache.pool.lock_waits()
        if waits is not None and waits.count:
            line += (f"; pool lock waits {waits.count} ({waits.seconds * 1e3:.0f} ms, longest "
                     f"{waits.longest_s * 1e3:.1f} ms by {waits.longest_by})")
        if waits is not None:  # the events this line shows, from the same reading (a later one may hold more)
            line += _long_lock_events(waits, self._lock_events_shown)
            self._lock_events_in_line = max([self._lock_events_shown]
                                            + [e.at for e in waits.long_holds + waits.long_waits])
        if self.offload is not None:
            o = self.offload.stats()
            line += (f"; host tier {format_size(o['host_bytes_used'])}, hits {o['host_hits']}, misses "
                     f"{o['host_misses']}, spilled {format_size(o['spilled_bytes'])}, reloaded "
                     f"{format_size(o['reloaded_bytes'])}, ARC p {o['arc_p']}")
            if "host_loads_async" in o:  # hits load beside compute (kvelastic.offload.plan)
                # in front of the step: the runs the lookups served (lone requests)
                line += (f"; loads beside compute {o['host_loads_async']}, in front of the step "
                         f"{o['load_runs']}, failed {o['host_loads_failed']}, lookups deferred "
                         f"{o['host_loads_deferred']}")
            if "load_seconds" in o:  # the copies' own GPU time: what the copies cost the engine
                line += (f"; copies on the GPU: spill {o['store_seconds']:.2f} s ({_rate(o, 'store')}), "
                         f"reload {o['load_seconds']:.2f} s ({_rate(o, 'load')})")
            if "stored_ahead_bytes" in o:  # write-through: what of the spilled bytes went beside compute
                line += (f"; write-through {format_size(o['stored_ahead_bytes'])} of it, evictions free "
                         f"{o['evicted_free']}, fences {o['store_fences']}")
                if "copy_waits" in o:  # the stores run on a stream of their own
                    line += f", copies after a store {o['copy_waits']}"
        return line


class MetricsPublish:
    """Writes the numbers behind the kvelastic_* metrics on every tick."""

    under_scheduler_lock = False

    def __init__(self, publisher: "StatsPublisher", queue: "PageAwareFreeQueue", cache: SchedulerCache,
                 offload: OffloadStatistics | None = None, reclaim: "ReclaimTiming | None" = None):
        """``reclaim``: the engine's reclaim timing, where it is a member of a GPU's shared account."""
        self.publisher = publisher
        self.queue = queue
        self.cache = cache
        self.offload = offload
        self.reclaim = reclaim

    def run(self, now: float) -> None:
        observations = self.reclaim.take_observations() if self.reclaim is not None else None
        self.publisher.publish(self.snapshot(), observations)

    def snapshot(self) -> dict[str, Any]:
        stats = self.cache.pool.stats()
        values: dict[str, Any] = {"mapped_bytes": stats.mapped_bytes, "held_bytes": stats.held_bytes,
                                  "limit_bytes": stats.limit_bytes or 0,
                                  "cached_bytes": self.queue.cached_groups() * self.cache.group_bytes}
        waits = self.cache.pool.lock_waits()
        if waits is not None:
            values.update(pool_lock_waits=waits.count, pool_lock_wait_seconds=waits.seconds)
        if self.offload is not None:
            values.update(self.offload.stats())
        if self.reclaim is not None:
            values.update(self.reclaim.values())
        return values


def _long_lock_events(waits: "LockWaits", after: float) -> str:
    """The pool lock's long holds and waits since the last line: who held it, and who waited behind whom."""
    holds = [f"{e.who} {e.seconds * 1e3:.1f} ms" for e in waits.long_holds if e.at > after]
    waited = [f"{e.who} {e.seconds * 1e3:.1f} ms behind {e.behind or '?'}"
              for e in waits.long_waits if e.at > after]
    return ((f"; held long: {', '.join(holds)}" if holds else "")
            + (f"; waited long: {', '.join(waited)}" if waited else ""))


def _rate(stats: dict[str, Any], direction: str) -> str:
    seconds = stats[f"{direction}_seconds"]
    return f"{stats[f'{direction}_timed_bytes'] / seconds / 1e9:.1f} GB/s" if seconds > 0 else "-"
