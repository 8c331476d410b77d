"""The engine's upkeep thread: a few times a second it runs a list of periodic jobs, in order.

Each job owns one task (the shared account, reclaiming memory, the warm
reserve, the log line, the metrics snapshot, retiring old pools) and gets what
it needs when it is built. The thread only keeps time and runs a job that
changes the block pool under the scheduler's lock, so it never races a
scheduling step. :func:`engine_upkeep` composes the jobs an engine runs.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol, Sequence

from kvelastic.scheduler.engine_report import MetricsPublish, StatsLog
from kvelastic.scheduler.reclaimer import AccountSync, CacheReclaim, OffloadStatistics, WarmReserve
from kvelastic.roles import SchedulerCache

if TYPE_CHECKING:
    from kvelastic.roles import AccountLink
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.scheduler.reload_reserve import ReloadReserve
    from kvelastic.metrics.metrics import StatsPublisher

log = logging.getLogger("vllm.kvelastic")


class PeriodicJob(Protocol):
    """One task of the upkeep thread, run on every tick."""

    #: True for a job that changes the block pool or its queue: it runs under the scheduler's lock.
    under_scheduler_lock: bool

    def run(self, now: float) -> None: ...


class EachTick:
    """A plain callable as a job (retiring replaced pools, or a test's probe)."""

    under_scheduler_lock = False

    def __init__(self, callback: Callable[[], None]):
        self.callback = callback

    def run(self, now: float) -> None:
        self.callback()


class UpkeepThread:
    """Runs :meth:`tick` every ``interval_s`` on a daemon thread until :meth:`stop`."""

    def __init__(self, jobs: Sequence[PeriodicJob], lock: ContextManager, *, interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic):
        """``lock``: the scheduler's lock, taken around each job that changes the block pool."""
        self.jobs = list(jobs)
        self.lock = lock
        self.interval_s = interval_s
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticking = threading.Lock()  # held for a whole tick: pause() waits for the one under way
        self._paused = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvelastic-upkeep", daemon=True)
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
                log.exception("kvelastic: upkeep tick failed; will retry")

    def pause(self) -> None:
        """Run no job until :meth:`resume`; returns once a tick under way has ended. Called without the
        scheduler's lock (a tick may be waiting for it)."""
        with self._ticking:
            self._paused = True

    def resume(self) -> None:
        self._paused = False

    def tick(self) -> None:
        """One round of every job (none while paused); safe to call from tests without the thread."""
        with self._ticking:
            if self._paused:
                return
            now = self.clock()
            for job in self.jobs:
                if job.under_scheduler_lock:
                    with self.lock:
                        job.run(now)
                else:
                    job.run(now)


def engine_upkeep(queue: "PageAwareFreeQueue", cache: SchedulerCache, lock: ContextManager, *,
                  cache_ttl_s: float, reserve_bytes: int, offload: OffloadStatistics | None = None,
                  link: "AccountLink | None" = None, publisher: "StatsPublisher | None" = None,
                  rank_held_bytes: Callable[[], list[int]] | None = None,
                  after_tick: Callable[[], None] | None = None, interval_s: float = 0.25,
                  reloads: "ReloadReserve | None" = None,
                  clock: Callable[[], float] = time.monotonic) -> UpkeepThread:
    """The upkeep of one engine, its jobs in the order one tick runs them.

    ``link``: the engine's membership in the GPU's shared account, if it joined one;
    ``publisher``: the metrics snapshot's writer; ``after_tick``: run last on every tick;
    ``reloads``: how far the warm reserve grows for host-tier reloads.
    """
    account = AccountSync(link, queue, offload) if link is not None else None
    jobs: list[PeriodicJob] = [] if account is None else [account]
    jobs += [CacheReclaim(queue, cache, cache_ttl_s=cache_ttl_s, account=account),
             WarmReserve(queue, cache, reserve_pages=reserve_bytes // cache.pool.page_bytes,
                         cache_ttl_s=cache_ttl_s, reloads=reloads, account=account),
             StatsLog(cache, offload, rank_held_bytes=rank_held_bytes)]
    if publisher is not None:
        jobs.append(MetricsPublish(publisher, queue, cache, offload, link.timing if link is not None else None))
    if after_tick is not None:
        jobs.append(EachTick(after_tick))
    return UpkeepThread(jobs, lock, interval_s=interval_s, clock=clock)
