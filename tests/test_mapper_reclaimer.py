"""The group mapper (inline and threaded), the reclaimer's upkeep, and attaching a scheduler.

Everything runs over the host backend. The reclaimer tests use vLLM's real
``BlockPool`` made page-aware; their clock is the real monotonic clock plus an
offset the test moves forward, so the queue's own time stamps stay real.
"""

from __future__ import annotations

import threading
import time
import types

import pytest

from kvelastic.errors import PatchError
from kvelastic.scheduler.mapper import GroupMapper
from kvelastic.scheduler.reclaimer import WarmReserve
from kvelastic.scheduler.upkeep import EachTick, UpkeepThread, engine_upkeep
from kvelastic.startup.runtime import Runtime
from kvelastic.hooks.scheduler import LOCKED_METHODS, attach_scheduler
from kvelastic.pool import PagePool
from kvelastic.settings import Settings
from tests.kv_fixtures import (BLOCKS_PER_GROUP, BS, GROUP_BYTES, GROUP_PAGES, HALF, LAYERS, PAGE, N,  # noqa: F401
                                Clock, Engine, StandInRequest, build_cache)
from tests.scheduler_harness import scheduler_patcher

TTL = 100.0


@pytest.fixture
def cache_and_pool():
    pool, views, cache = build_cache()
    yield cache, pool
    pool.close()
    assert pool.leak_report() == []



class GatedBackend:
    """Makes the host backend's map calls wait for a gate and remember which thread ran them."""

    def __init__(self, pool: PagePool, monkeypatch):
        self.gate = threading.Event()
        self.gate.set()
        self.threads: list[str] = []
        self.fail_next = False
        original = pool.backend.map_runs

        def map_runs(runs, page_bytes, *, zero):
            self.threads.append(threading.current_thread().name)
            assert self.gate.wait(10), "gate never opened"
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("driver hiccup")
            return original(runs, page_bytes, zero=zero)

        monkeypatch.setattr(pool.backend, "map_runs", map_runs)


def in_thread(function, *args) -> threading.Thread:
    thread = threading.Thread(target=function, args=args, daemon=True)
    thread.start()
    return thread


# ----------------------------------------------------------------- GroupMapper
def test_inline_mapper_runs_each_command_at_once_and_in_order(cache_and_pool):
    cache, pool = cache_and_pool
    mapper = GroupMapper(cache)
    assert pool.mapped_groups() == {0}  # the null block's group is mapped with the cache
    mapper.request_map([1, 2])
    assert pool.mapped_groups() == {0, 1, 2}
    assert list(mapper.mapped) == [1, 2] and not mapper.refused
    mapper.request_unmap([2])
    mapper.request_map([2])
    assert pool.is_mapped(2)
    mapper.request_map([3])
    mapper.request_unmap([3])
    assert not pool.is_mapped(3)
    mapper.request_unmap([0])  # the null group is never unmapped
    assert pool.is_mapped(0)
    mapper.map_now([4])
    assert pool.mapped_groups() == {0, 1, 2, 4}
    assert list(mapper.mapped) == [1, 2, 2, 3, 4]


def test_threaded_mapper_keeps_command_order_and_runs_on_its_own_thread(cache_and_pool, monkeypatch):
    cache, pool = cache_and_pool
    backend = GatedBackend(pool, monkeypatch)
    mapper = GroupMapper(cache)
    mapper.start()
    try:
        backend.gate.clear()
        mapper.request_map([1])
        mapper.request_unmap([1])
        mapper.request_map([1])
        mapper.request_map([2])
        mapper.request_unmap([2])
        assert not mapper.mapped  # queued, not done: request_* never waits (the pool's lock is busy now)
        backend.gate.set()
        mapper.map_now([3])
        assert pool.mapped_groups() == {0, 1, 3}
        assert set(backend.threads) == {"kvelastic-mapper"}
    finally:
        mapper.stop()
    assert mapper._thread is None


@pytest.fixture
def gated_mapper(cache_and_pool, monkeypatch):
    """A threaded mapper whose driver calls wait while ``backend.gate`` is clear (it starts clear)."""
    cache, pool = cache_and_pool
    backend = GatedBackend(pool, monkeypatch)
    mapper = GroupMapper(cache)
    mapper.start()
    backend.gate.clear()
    yield mapper, backend, pool
    backend.gate.set()
    mapper.stop()


def test_map_now_waits_until_the_groups_are_mapped(gated_mapper):
    mapper, backend, pool = gated_mapper
    waiter = in_thread(mapper.map_now, [5, 6])
    waiter.join(0.2)
    assert waiter.is_alive(), "map_now returned before its groups were mapped"
    assert not mapper.mapped
    backend.gate.set()
    waiter.join(5)
    assert not waiter.is_alive()
    assert pool.is_mapped(5) and pool.is_mapped(6)
    mapper.map_now([])  # nothing queued: returns at once


def test_map_now_with_no_groups_waits_for_maps_requested_earlier(gated_mapper):
    """A burst that needs groups the prefetch already requested must wait for them, not fail."""
    mapper, backend, _ = gated_mapper
    mapper.request_map([7])
    waiter = in_thread(mapper.map_now, [])
    waiter.join(0.2)
    assert waiter.is_alive(), "map_now([]) returned while an earlier map was still queued"
    backend.gate.set()
    waiter.join(5)
    assert not waiter.is_alive() and list(mapper.mapped) == [7]


def test_groups_over_the_limit_are_refused_one_by_one(cache_and_pool):
    cache, pool = cache_and_pool
    pool.set_limit(3 * GROUP_BYTES)  # group 0 and two more
    mapper = GroupMapper(cache)
    mapper.request_map([1, 2, 3, 4])
    assert pool.mapped_groups() == {0, 1, 2}
    assert list(mapper.mapped) == [1, 2]
    assert list(mapper.refused) == [3, 4]
    assert pool.stats().held_bytes == 3 * GROUP_BYTES


def test_a_refused_map_now_still_returns_on_the_threaded_mapper(cache_and_pool):
    cache, pool = cache_and_pool
    pool.set_limit(2 * GROUP_BYTES)
    mapper = GroupMapper(cache)
    mapper.start()
    try:
        waiter = in_thread(mapper.map_now, [1, 2])
        waiter.join(5)
        assert not waiter.is_alive(), "map_now hung on a refused group"
        assert list(mapper.mapped) == [1] and list(mapper.refused) == [2]
    finally:
        mapper.stop()


def test_the_worker_survives_a_failed_command(cache_and_pool, monkeypatch, kv_log):
    cache, pool = cache_and_pool
    backend = GatedBackend(pool, monkeypatch)
    mapper = GroupMapper(cache)
    mapper.start()
    try:
        backend.fail_next = True
        waiter = in_thread(mapper.map_now, [1])
        waiter.join(5)
        assert not waiter.is_alive(), "map_now hung after the worker hit an error"
        assert not pool.is_mapped(1)
        mapper.map_now([2])
        assert pool.is_mapped(2)
        assert pool.stats().held_bytes == 2 * GROUP_BYTES + pool.stats().reserve_bytes
    finally:
        mapper.stop()
    assert any("group mapper failed" in r.getMessage() for r in kv_log.records)


# ------------------------------------------------- upkeep: reclaiming memory, the warm reserve
block_pool_module = pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")


@pytest.fixture
def engine():
    from kvelastic.hooks.block_pool import make_page_aware

    pool, views, cache = build_cache()
    bp = block_pool_module.BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    queue = make_page_aware(bp, cache, GroupMapper(cache), patcher=scheduler_patcher())
    engine = Engine(pool=pool, views=views, cache=cache, bp=bp, queue=queue, clock=Clock())
    yield engine
    pool.close()
    assert pool.leak_report() == []


def reclaimer_for(engine, *, ttl=TTL, reserve_pages=0, **kwargs) -> UpkeepThread:
    return engine_upkeep(engine.queue, engine.cache, threading.RLock(), cache_ttl_s=ttl,
                         reserve_bytes=reserve_pages * PAGE, clock=engine.clock, **kwargs)


def cache_and_free(bp, count: int, tag: str) -> list:
    blocks = bp.get_new_blocks(count)
    bp.cache_full_blocks(StandInRequest([f"{tag}{i}".encode() for i in range(count)]), blocks, 0, count, BS, 0)
    bp.free_blocks(blocks)
    return blocks


def cached(bp, tag: str, index: int) -> bool:
    return bp.get_cached_block(f"{tag}{index}".encode(), [0]) is not None


def indices_in_group(engine, blocks: list, group: int) -> list[int]:
    """Positions (hash tags) of ``blocks`` that live in ``group``."""
    return [i for i, block in enumerate(blocks) if engine.cache.group_of_block(block.block_id) == group]


def all_cached(engine, tag: str, indices: list[int]) -> bool:
    assert indices
    return all(cached(engine.bp, tag, i) for i in indices)


def none_cached(engine, tag: str, indices: list[int]) -> bool:
    assert indices
    return not any(cached(engine.bp, tag, i) for i in indices)


def test_cached_groups_are_released_once_idle_past_the_ttl_and_not_before(engine):
    blocks = cache_and_free(engine.bp, 63, "a")  # blocks 1..63: groups 0 and 1
    assert sorted(b.block_id for b in blocks) == list(range(1, 64))
    in_0, in_1 = indices_in_group(engine, blocks, 0), indices_in_group(engine, blocks, 1)
    assert engine.pool.mapped_groups() == {0, 1, 2}  # group 2 is mapped ahead of need
    reclaimer = reclaimer_for(engine)

    engine.clock.offset = TTL - 10
    reclaimer.tick()
    assert engine.pool.mapped_groups() == {0, 1, 2}
    assert all_cached(engine, "a", in_1)

    engine.clock.offset = TTL + 10
    reclaimer.tick()
    assert not engine.pool.is_mapped(1)
    assert none_cached(engine, "a", in_1)  # evicted through vLLM's own bookkeeping
    assert all_cached(engine, "a", in_0)  # group 0 holds the null block and is never released
    assert engine.queue.prefetch.groups == 0  # idle too: nothing kept ahead
    assert engine.pool.mapped_groups() == {0}
    assert engine.bp.get_num_free_blocks() == N - 1


def test_an_infinite_ttl_never_releases_cached_groups(engine):
    blocks = cache_and_free(engine.bp, 63, "a")
    reclaimer = reclaimer_for(engine, ttl=float("inf"))
    engine.clock.offset = 1e9
    reclaimer.tick()
    assert engine.pool.is_mapped(1) and all_cached(engine, "a", indices_in_group(engine, blocks, 1))


def test_a_lowered_limit_releases_cached_groups_until_under_it(engine):
    blocks = cache_and_free(engine.bp, 127, "a")  # blocks 1..127: groups 0..3, all cached
    assert engine.pool.mapped_groups() == {0, 1, 2, 3, 4}
    engine.pool.set_limit(3 * GROUP_BYTES)
    assert engine.pool.stats().over_limit_bytes == 2 * GROUP_BYTES
    reclaimer = reclaimer_for(engine)
    reclaimer.tick()  # busy: the TTL has not passed, only the limit forces the release
    stats = engine.pool.stats()
    assert stats.over_limit_bytes == 0
    assert stats.held_bytes == 3 * GROUP_BYTES
    # the empty group mapped ahead (4) goes first, then the oldest cached group (1)
    assert engine.pool.mapped_groups() == {0, 2, 3}
    assert none_cached(engine, "a", indices_in_group(engine, blocks, 1))
    assert all_cached(engine, "a", indices_in_group(engine, blocks, 0) + indices_in_group(engine, blocks, 2)
                      + indices_in_group(engine, blocks, 3))


def test_live_blocks_are_never_released_to_meet_a_limit(engine):
    live = engine.bp.get_new_blocks(60)  # groups 0 and 1 in use
    assert {engine.cache.group_of_block(b.block_id) for b in live} == {0, 1}
    freed = cache_and_free(engine.bp, 30, "b")  # the rest of group 1, then group 2: cached
    engine.pool.set_limit(GROUP_BYTES)
    reclaimer = reclaimer_for(engine)
    reclaimer.tick()
    assert {0, 1} <= engine.pool.mapped_groups()
    assert not engine.pool.is_mapped(2)
    assert none_cached(engine, "b", indices_in_group(engine, freed, 2))
    assert all_cached(engine, "b", indices_in_group(engine, freed, 1))  # group 1 is in use: kept
    for block in live:
        for view in engine.views:
            view[:, block.block_id].fill_(1.0)  # live memory stays usable
    engine.bp.free_blocks(live)


def test_a_lowered_limit_also_releases_empty_prefetched_groups(engine):
    live = engine.bp.get_new_blocks(40)  # groups 0 and 1 in use, group 2 mapped ahead
    assert engine.pool.mapped_groups() == {0, 1, 2}
    engine.pool.set_limit(2 * GROUP_BYTES)
    reclaimer_for(engine).tick()
    assert engine.pool.stats().over_limit_bytes == 0
    engine.bp.free_blocks(live)


def test_the_reserve_grows_while_busy_and_is_trimmed_when_idle(engine):
    live = engine.bp.get_new_blocks(10)
    reclaimer = reclaimer_for(engine, reserve_pages=4)
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == 4 * PAGE
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == 4 * PAGE  # topped up, not grown again
    assert engine.queue.prefetch.groups >= 1

    engine.clock.offset = TTL + 10
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == 0
    assert engine.queue.prefetch.groups == 0
    assert engine.pool.mapped_groups() == {0}  # only the group of the live blocks
    engine.bp.free_blocks(live)


def test_the_warm_reserve_is_parked_where_vllm_takes_blocks_next(engine, monkeypatch):
    live = engine.bp.get_new_blocks(10)
    reclaimer_for(engine, reserve_pages=2 * GROUP_PAGES).tick()
    before = engine.pool.mapped_groups()
    parked = engine.pool.parked_groups()
    assert parked == set(sorted(set(range(engine.cache.num_groups)) - before)[:2])
    pages_mapped = []
    original = engine.pool.backend.map_runs
    monkeypatch.setattr(engine.pool.backend, "map_runs",
                        lambda runs, *a, **k: (pages_mapped.append(sum(len(r.handles) for r in runs)),
                                               original(runs, *a, **k)))
    taken = engine.bp.get_new_blocks(BLOCKS_PER_GROUP * (len(before) + 1))  # into the parked groups
    newly = engine.pool.mapped_groups() - before
    assert parked <= newly
    assert sum(pages_mapped) == (len(newly) - len(parked)) * GROUP_PAGES  # parked groups cost no mapping
    engine.bp.free_blocks(taken + live)


def test_the_reserve_stays_within_the_limit(engine):
    engine.bp.get_new_blocks(10)
    held = engine.pool.stats().held_bytes
    engine.pool.set_limit(held + 2 * PAGE)
    reclaimer_for(engine, reserve_pages=4).tick()
    stats = engine.pool.stats()
    assert stats.reserve_bytes == 2 * PAGE
    assert stats.over_limit_bytes == 0


def test_the_reclaimer_thread_ticks_until_stopped_and_survives_errors(engine, kv_log):
    ticks: list[float] = []
    second = threading.Event()

    def after_tick():
        ticks.append(time.monotonic())
        if len(ticks) == 1:
            raise RuntimeError("upkeep hiccup")
        second.set()

    reclaimer = reclaimer_for(engine, interval_s=0.01, after_tick=after_tick)
    reclaimer.start()
    try:
        assert second.wait(5), "the reclaimer stopped after a failed tick"
    finally:
        reclaimer.stop()
    assert not reclaimer._thread.is_alive()
    count = len(ticks)
    time.sleep(0.05)
    assert len(ticks) == count
    assert any("upkeep tick failed" in r.getMessage() for r in kv_log.records)


class LockProbe:
    """A job that notes its name, and whether the scheduler's lock was held, each time it runs."""

    def __init__(self, name: str, lock: threading.Lock, under_scheduler_lock: bool, runs: list):
        self.name, self.lock, self.runs = name, lock, runs
        self.under_scheduler_lock = under_scheduler_lock

    def run(self, now: float) -> None:
        self.runs.append((self.name, self.lock.locked(), now))


def test_upkeep_runs_its_jobs_in_order_and_only_block_pool_jobs_under_the_lock():
    lock = threading.Lock()
    runs: list = []
    jobs = [LockProbe("reclaim", lock, True, runs), EachTick(lambda: runs.append("after")),
            LockProbe("report", lock, False, runs)]
    upkeep = UpkeepThread(jobs, lock, clock=iter([5.0, 6.0]).__next__)
    upkeep.tick()
    upkeep.tick()
    assert runs == [("reclaim", True, 5.0), "after", ("report", False, 5.0),
                    ("reclaim", True, 6.0), "after", ("report", False, 6.0)]
    assert not lock.locked()


# ------------------------------------------------------------ attach_scheduler
def _scheduler_with(world: int = 1, pipeline: int = 1) -> types.SimpleNamespace:
    parallel = types.SimpleNamespace(world_size=world * pipeline, pipeline_parallel_size=pipeline,
                                     distributed_executor_backend="mp")
    return types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=parallel), connector=None)


def test_attach_scheduler_without_a_cache_or_ranks_explains_why():
    runtime = Runtime(Settings(enabled=True))  # no cache here, and no executor brought ranks' descriptions back
    with pytest.raises(PatchError) as info:
        attach_scheduler(_scheduler_with(world=2), runtime, scheduler_patcher())
    message = str(info.value)
    assert "no elastic KV cache in its process" in message
    assert "its executor ('mp') asked no worker rank for one" in message
    assert "KVELASTIC=0" in message


def test_attach_scheduler_makes_the_block_pool_page_aware_and_locks_the_entry_points():
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue

    pool, views, cache = build_cache()
    runtime = Runtime(Settings(enabled=True, prefetch_bytes=3 * GROUP_BYTES, reserve_bytes=2 * PAGE,
                               chunk_bytes=2 * 1024 * 1024))
    runtime.plan_capacity(profiled_bytes=5 * GROUP_BYTES, device_total_bytes=64 * 1024 * 1024)
    runtime.publish(cache)
    bp = block_pool_module.BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    contested: list[bool] = []

    def schedule():
        probe = in_thread(lambda: contested.append(reclaimer.lock.acquire(blocking=False)))
        probe.join(5)
        return "scheduled"

    coordinator = types.SimpleNamespace(get_num_blocks_to_allocate=lambda request_id, num_tokens: num_tokens)
    scheduler = types.SimpleNamespace(kv_cache_manager=types.SimpleNamespace(block_pool=bp, coordinator=coordinator),
                                      schedule=schedule, update_from_output=lambda *a: a,
                                      finish_requests=lambda *a: None, reset_prefix_cache=lambda *a: True,
                                      connector=None, finished_req_ids=set(),
                                      vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(
                                          model="stand-in", served_model_name="stand-in")))
    reclaimer = attach_scheduler(scheduler, runtime, scheduler_patcher())
    queue = bp.free_block_queue
    try:
        assert scheduler.kvelastic_reclaimer is reclaimer
        assert isinstance(queue, PageAwareFreeQueue) and bp.kvelastic_queue is queue
        assert pool.stats().limit_bytes == 5 * GROUP_BYTES
        assert queue.prefetch.max_groups == 3
        assert [j.reserve_pages for j in reclaimer.jobs if isinstance(j, WarmReserve)] == [2]
        assert scheduler.schedule() == "scheduled"
        assert contested == [False]  # the reclaimer's lock was held during schedule()
        assert scheduler.update_from_output(1, 2) == (1, 2)
        assert coordinator.get_num_blocks_to_allocate("r", 40) == 40  # wrapped on the instance, value unchanged
        assert queue.hold.secured == 40 and queue.num_free_blocks >= 40
        scheduler.schedule()
        assert queue.hold.secured == 0  # a step's promise ends with the step
        assert scheduler.reset_prefix_cache() is True
        assert set(LOCKED_METHODS) == {"schedule", "update_from_output", "finish_requests", "reset_prefix_cache"}
        blocks = bp.get_new_blocks(70)
        assert {cache.group_of_block(b.block_id) for b in blocks} == {0, 1, 2}
        bp.free_blocks(blocks)
    finally:
        reclaimer.stop()
        queue.mapper.stop()
        pool.close()
    assert pool.leak_report() == []


def test_burst_prefetch_follows_the_window_maximum_and_its_cap():
    from kvelastic.scheduler.prefetch import BurstPrefetch

    prefetch = BurstPrefetch(blocks_per_group=10, max_groups=4, window_s=2.0)
    assert prefetch.note(0.0, 25) == 4  # 3 groups for the burst, plus one
    assert prefetch.note(1.0, 5) == 4  # the larger burst is still in the window
    assert prefetch.note(2.5, 5) == 2  # it left the window
    assert prefetch.note(3.0, 500) == 4  # capped
    prefetch.clear()
    assert prefetch.groups == 0
