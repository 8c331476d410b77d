"""The page pool's lock counts the waits to take it; the engine's log line and metrics report them."""

from __future__ import annotations

import threading
import time
import types

from kvelastic.pool.host import HostBackend
from kvelastic.pool.lock_waits import CountedLock
from kvelastic.pool.page_pool import PagePool
from kvelastic.pool.sources import DeviceSource, LimitedSource, ReserveSource
from kvelastic.pool.stats import StatisticsSource

PAGE = 2 * 1024 * 1024


def hold_in_thread(lock_user, held: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=lock_user, name="holder")
    thread.start()
    assert held.wait(5), "the holder never took the lock"
    return thread


def test_taking_a_free_lock_again_and_again_counts_no_wait():
    lock = CountedLock()
    for _ in range(1000):
        with lock:
            with lock:  # re-entrant, as the pool's own calls nest
                pass
    assert lock.waits().count == 0 and lock.waits().longest_by == ""


def wait_behind_a_holder(lock: CountedLock, hold_s: float) -> None:
    """Take ``lock`` here while another thread holds it for about ``hold_s``."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait(5)

    thread = hold_in_thread(holder, held)
    threading.Timer(hold_s, release.set).start()
    with lock:
        pass
    thread.join()


def test_a_thread_that_waits_for_the_holder_is_counted_by_name():
    lock = CountedLock()
    wait_behind_a_holder(lock, 0.05)
    waits = lock.waits()
    assert waits.count == 1 and waits.longest_by == threading.current_thread().name
    assert 0.03 <= waits.seconds == waits.longest_s < 5


def test_waits_under_a_millisecond_are_not_counted():
    ticks = iter(range(1000))
    # every wait reads as half a millisecond (the holder's own clock reads do not advance it)
    lock = CountedLock(clock=lambda: 0.0 if threading.current_thread().name == "holder" else next(ticks) * 0.0005)
    wait_behind_a_holder(lock, 0.02)
    assert lock.waits().count == 0


class SlowPages(HostBackend):
    """Host pages that take as long to create as a page group's driver calls under a busy engine's GIL."""

    def __init__(self, creating: threading.Event):
        super().__init__()
        self.creating = creating

    def create_page(self, nbytes: int):
        self.creating.set()
        time.sleep(0.03)
        return super().create_page(nbytes)


def test_a_step_waiting_while_the_reserve_grows_shows_in_the_log_line_and_the_metrics():
    from kvelastic.scheduler.engine_report import MetricsPublish, StatsLog

    creating = threading.Event()
    pool = PagePool.standard(SlowPages(creating), page_bytes=PAGE)
    try:
        cache = types.SimpleNamespace(pool=pool, group_bytes=PAGE)
        assert "pool lock waits" not in StatsLog(cache).line()  # type: ignore[arg-type]
        grower = hold_in_thread(lambda: pool.grow_reserve(2), creating)  # the upkeep thread's growth
        pool.stats()  # a step's call into the pool, behind the growth's lock
        grower.join()
        waits = pool.lock_waits()
        assert waits.count == 1 and waits.longest_by == threading.current_thread().name and waits.seconds >= 0.02
        line = StatsLog(cache).line()  # type: ignore[arg-type]
        assert f"; pool lock waits 1 ({waits.seconds * 1e3:.0f} ms, longest " in line
        me = threading.current_thread().name
        assert f"by {me}); held long: holder in grow_reserve " in line  # the growth, named by thread and method
        assert line.endswith(" ms behind holder in grow_reserve")  # and the step's wait behind it
        assert f"; waited long: {me} " in line
        queue = types.SimpleNamespace(cached_groups=lambda: 0)
        values = MetricsPublish(None, queue, cache).snapshot()  # type: ignore[arg-type]
        assert values["pool_lock_waits"] == 1 and values["pool_lock_wait_seconds"] == waits.seconds
    finally:
        pool.close()


def test_a_long_hold_is_named_by_thread_and_method_and_logged_once():
    from kvelastic.scheduler.engine_report import StatsLog

    lock = CountedLock()

    def resize_slowly() -> None:
        with lock:
            with lock:  # nested: one hold, named by the outermost method
                time.sleep(0.02)

    thread = threading.Thread(target=resize_slowly, name="grower")
    thread.start()
    thread.join()
    with lock:
        pass  # short: not a long hold
    holds = lock.waits().long_holds
    assert [h.who for h in holds] == ["grower in resize_slowly"] and 0.015 <= holds[0].seconds < 5
    assert lock.waits().long_waits == () and lock.waits().count == 0

    pool = types.SimpleNamespace(stats=lambda: types.SimpleNamespace(mapped_bytes=0, held_bytes=0, limit_bytes=0),
                                 lock_waits=lock.waits)
    log = StatsLog(types.SimpleNamespace(pool=pool), period_s=0)  # type: ignore[arg-type]
    assert "; held long: grower in resize_slowly " in log.line()
    log.run(1.0)  # logged: the next line does not repeat it
    assert "held long" not in log.line()


def test_a_long_hold_that_ends_while_a_line_is_logged_is_in_the_next_line():
    from kvelastic.pool.lock_waits import LockWaits, LongEvent
    from kvelastic.scheduler.engine_report import StatsLog

    first, second = LongEvent(1.0, 0.01, "a in grow_reserve"), LongEvent(2.0, 0.02, "b in trim_reserve")
    readings = [LockWaits(0, 0.0, 0.0, "", (first,)), LockWaits(0, 0.0, 0.0, "", (first, second))]

    def lock_waits() -> LockWaits:  # the first reading, then the second hold ended: every later reading
        return readings.pop(0) if len(readings) > 1 else readings[0]

    pool = types.SimpleNamespace(stats=lambda: types.SimpleNamespace(mapped_bytes=0, held_bytes=0, limit_bytes=0),
                                 lock_waits=lock_waits)
    log = StatsLog(types.SimpleNamespace(pool=pool), period_s=0)  # type: ignore[arg-type]
    log.run(1.0)  # its line shows the first hold; the second ends after that reading
    line = log.line()
    assert "b in trim_reserve 20.0 ms" in line and "a in grow_reserve" not in line


def test_only_the_latest_long_holds_are_kept():
    from kvelastic.pool.lock_waits import RECENT

    ticks = iter(range(10_000))
    lock = CountedLock(clock=lambda: next(ticks) * 0.01)  # every hold reads as 10 ms
    for _ in range(RECENT + 5):
        with lock:
            pass
    holds = lock.waits().long_holds
    assert len(holds) == RECENT and holds[-1].at > holds[0].at


class SlowDriver(HostBackend):
    """Host pages whose creation and release take as long as a page's driver calls beside a busy engine."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.started = threading.Event()

    def create_page(self, nbytes: int):
        self.started.set()
        time.sleep(self.seconds)
        return super().create_page(nbytes)

    def release_page(self, handle) -> None:
        self.started.set()
        time.sleep(self.seconds)
        super().release_page(handle)


def slow_pool(backend: SlowDriver) -> PagePool:
    """A pool whose reserve grows and trims two pages per call upstream (two slow driver calls a turn)."""
    device = StatisticsSource(DeviceSource(backend, PAGE))
    return PagePool(backend, ReserveSource(LimitedSource(device), batch_bytes=2 * PAGE), park=False)


def wait_beside(pool: PagePool, backend: SlowDriver, work) -> tuple[float, threading.Thread]:
    """Run ``work`` on an upkeep-like thread and, once its driver calls began, time a step's pool call."""
    thread = threading.Thread(target=work, name="kvelastic-upkeep")
    thread.start()
    assert backend.started.wait(5)
    start = time.perf_counter()
    pool.stats()  # the step's call into the pool
    return time.perf_counter() - start, thread


def test_growing_the_reserve_steps_aside_for_a_thread_that_waits_for_the_lock():
    backend = SlowDriver(0.015)
    pool = slow_pool(backend)
    try:
        start = time.perf_counter()
        waited, grower = wait_beside(pool, backend, lambda: pool.grow_reserve(12))
        grower.join()
        growth = time.perf_counter() - start
        assert growth >= 0.18  # twelve pages of 15 ms, in six calls of two
        assert waited < 0.1, f"the step waited {waited * 1e3:.0f} ms behind a {growth * 1e3:.0f} ms growth"
        assert pool.stats().reserve_bytes == 12 * PAGE  # and the growth still finished
        holds = pool.lock_waits().long_holds
        assert len([h for h in holds if h.who == "kvelastic-upkeep in grow_reserve"]) >= 2  # it took turns
    finally:
        pool.close()


def test_trimming_the_reserve_steps_aside_too_and_still_gives_every_page_back():
    backend = SlowDriver(0.0)
    pool = slow_pool(backend)
    try:
        assert pool.grow_reserve(12) == 12
        backend.seconds = 0.015
        backend.started.clear()
        waited, trimmer = wait_beside(pool, backend, lambda: pool.trim_reserve(2))
        trimmer.join()
        assert waited < 0.1, f"the step waited {waited * 1e3:.0f} ms behind the trim"
        assert pool.stats().reserve_bytes == 2 * PAGE and pool.stats().held_bytes == 2 * PAGE
    finally:
        pool.close()


def test_a_holder_nested_in_the_lock_never_steps_aside():
    lock = CountedLock()
    lock._waiters.add(-1)  # a thread waiting (a foreign ident: nothing real blocks here)
    with lock:
        time.sleep(0.003)  # past the shortest turn
        assert lock.others_waiting()
        with lock:
            assert not lock.others_waiting()  # releasing the inner hold would not let anyone in
    start = time.perf_counter()
    lock.let_waiters_in(patience_s=0.02)  # the "waiter" never takes it: give up after the patience
    assert 0.015 <= time.perf_counter() - start < 1


def test_a_pool_the_scheduler_sees_through_the_ranks_reports_has_no_lock_to_report():
    from kvelastic.tp.sharded_cache import ShardedPoolView

    assert object.__new__(ShardedPoolView).lock_waits() is None  # the ranks' pools are in their processes
