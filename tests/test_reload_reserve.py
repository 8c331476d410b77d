"""The warm reserve covers the longest host-tier run reloaded lately (``scheduler/reload_reserve.py``).

Over the host backend (real memory), vLLM's real ``BlockPool`` made
page-aware and the host tier's real manager: a run spilled and unmapped comes
back through vLLM's lookup, its length is kept, and the upkeep's warm reserve
grows to its page groups while the engine is busy, parked where the next
reload maps, within the limit and the shared account's room; it is given back
when other engines wait, when the engine idles and when the run ages out. A
second reload of the run then creates and maps no page, and its data is exact.
"""

from __future__ import annotations

import threading
import types

import pytest

from kvelastic.cluster import SharedAccount, SharedBudgetSource
from kvelastic.hooks.block_pool import make_page_aware
from kvelastic.hooks.offload_setup import local_host_tier, wire_offload
from kvelastic.hooks.scheduler import _reload_reserve
from kvelastic.offload.host_runs import HostRuns
from kvelastic.scheduler.mapper import GroupMapper
from kvelastic.scheduler.reclaimer import BUSY_STEP_BYTES, CacheReclaim, WarmReserve
from kvelastic.scheduler.reload_reserve import MAX_BYTES, ReloadReserve
from kvelastic.scheduler.upkeep import UpkeepThread, engine_upkeep
from tests.host_plans import BESIDE_A_CONNECTOR
from tests.kv_fixtures import (BLOCKS_PER_GROUP, BS, GROUP_BYTES, GROUP_PAGES, PAGE, N, Clock, Engine,
                                StandInRequest, build_cache)
from tests.scheduler_harness import scheduler_patcher

block_pool_module = pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

TTL = 100.0
RUN = 2 * BLOCKS_PER_GROUP + 5  # a run over three groups


def make_engine(*, cap_bytes: int = 8 * GROUP_BYTES, limit_groups: int | None = None, wrap_device=None,
                busy_step_bytes: int = BUSY_STEP_BYTES) -> Engine:
    """An engine whose host tier loads hits in front of the step (as beside a vLLM connector), its reserve
    for reloads capped at ``cap_bytes`` (the engine's :data:`MAX_BYTES` is larger than this test's cache)
    and grown ``busy_step_bytes`` a tick while requests run."""
    pool, views, cache = build_cache(limit_groups, wrap_device=wrap_device)
    bp = block_pool_module.BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    queue = make_page_aware(bp, cache, GroupMapper(cache), patcher=scheduler_patcher())
    tier, copier = local_host_tier(cache, 1 << 24, "arc", BESIDE_A_CONNECTOR)
    manager = wire_offload(bp, queue, tier, copier, scheduler_patcher(), BESIDE_A_CONNECTOR)
    return Engine(pool=pool, views=views, cache=cache, bp=bp, queue=queue, tier=tier, manager=manager,
                  cap_bytes=cap_bytes, busy_step_bytes=busy_step_bytes, clock=Clock(),
                  held=bp.get_new_blocks(BLOCKS_PER_GROUP - 1))


def upkeep(engine: Engine, *, reserve_pages: int = 1, account=None) -> UpkeepThread:
    reloads = _reload_reserve(engine.manager, engine.cache)
    reloads.cap_bytes = engine.cap_bytes
    if account is None:
        thread = engine_upkeep(engine.queue, engine.cache, threading.RLock(), cache_ttl_s=TTL,
                               reserve_bytes=reserve_pages * PAGE, offload=engine.manager, reloads=reloads,
                               clock=engine.clock)
        warm = next(job for job in thread.jobs if isinstance(job, WarmReserve))
        warm.busy_step_bytes = engine.busy_step_bytes
        return thread
    jobs = [CacheReclaim(engine.queue, engine.cache, cache_ttl_s=TTL, account=account),
            WarmReserve(engine.queue, engine.cache, reserve_pages=reserve_pages, cache_ttl_s=TTL,
                        reloads=reloads, account=account, busy_step_bytes=engine.busy_step_bytes)]
    return UpkeepThread(jobs, threading.RLock(), clock=engine.clock)


def spill_a_run(engine: Engine, tag: str = "p", n: int = RUN) -> list[bytes]:
    """Compute ``n`` blocks of one prefix, stamp them, free them, and spill and unmap them."""
    blocks = engine.bp.get_new_blocks(n)
    for i, block in enumerate(blocks):
        for view in engine.views:
            view[:, block.block_id].fill_(i % 100 + 1)
    hashes = [f"{tag}{i}".encode() for i in range(n)]
    engine.bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, n, BS, 0)
    engine.bp.free_blocks(blocks)
    engine.queue.reclaim_cached(groups_wanted=engine.cache.num_groups)
    assert not any(engine.pool.is_mapped(engine.cache.group_of_block(b.block_id)) for b in blocks)
    return hashes


def reload(engine: Engine, hashes: list[bytes]) -> list:
    """vLLM's lookup, block by block, then the step's end; every block must come back exactly."""
    found = [engine.bp.get_cached_block(h, [0])[0] for h in hashes]
    engine.manager.flush()
    for i, block in enumerate(found):
        assert {int(v) for view in engine.views for v in view[:, block.block_id].unique()} == {i % 100 + 1}
    return found


def spill_again_and_give_back(engine: Engine) -> None:
    """The reloaded run's groups spill and unmap again and their pages go back to the device (as when idle):
    a later reserve holds only what the upkeep grows, not the pages recycled by the release."""
    assert engine.queue.reclaim_cached(groups_wanted=engine.cache.num_groups) >= 3
    engine.pool.collect(wait=True)
    engine.pool.trim_reserve(0)


def a_run_reloaded_and_given_back(engine: Engine) -> None:
    """A long run spilled, reloaded exactly, then spilled again with its pages given back: what the
    upkeep's next tick sizes the reserve from."""
    reload(engine, spill_a_run(engine))
    spill_again_and_give_back(engine)


def close(engine: Engine) -> None:
    engine.bp.free_blocks(engine.held)
    engine.pool.close()
    assert engine.pool.leak_report() == []


def test_the_reserve_grows_to_a_reloaded_run_while_busy_and_the_next_reload_creates_and_maps_nothing(monkeypatch):
    engine = make_engine()
    reclaimer = upkeep(engine)
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == PAGE  # no run yet: the usual reserve
    hashes = spill_a_run(engine)
    reload(engine, hashes)
    assert engine.manager.runs.longest() == RUN
    spill_again_and_give_back(engine)
    reclaimer.tick()
    stats = engine.pool.stats()
    assert stats.reserve_bytes == 3 * GROUP_BYTES  # three groups, parked where the next maps go
    assert len(engine.pool.parked_groups()) == 3
    before, parked, created = engine.pool.mapped_groups(), engine.pool.parked_groups(), stats.pages_created
    mapped: list[int] = []
    original = engine.pool.backend.map_runs
    monkeypatch.setattr(engine.pool.backend, "map_runs",
                        lambda runs, *a, **k: (mapped.append(sum(len(r.handles) for r in runs)),
                                               original(runs, *a, **k))[1])
    found = reload(engine, hashes)  # exact, into the parked groups
    assert parked <= {engine.cache.group_of_block(b.block_id) for b in found}
    newly = engine.pool.mapped_groups() - before
    unparked = len(newly) - len(parked)  # groups mapped ahead beside the run (the queue's prefetch), if any
    assert sum(mapped) == unparked * GROUP_PAGES  # the parked groups cost no driver call
    assert engine.pool.stats().pages_created - created == unparked * GROUP_PAGES  # nor a new page
    close(engine)


def test_the_reserve_for_reloads_stays_within_the_limit():
    engine = make_engine()
    reclaimer = upkeep(engine)
    a_run_reloaded_and_given_back(engine)
    engine.pool.set_limit(engine.pool.stats().held_bytes + 2 * GROUP_BYTES)  # room for two of the run's three groups
    reclaimer.tick()
    stats = engine.pool.stats()
    assert stats.reserve_bytes == 2 * GROUP_BYTES and stats.over_limit_bytes == 0
    close(engine)


def test_the_reserve_for_reloads_stays_within_the_shared_accounts_room(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    budget = 10 * GROUP_BYTES
    with SharedAccount.open("host-reload", budget) as account:
        member = account.join("a")
        other = account.join("b")
        engine = make_engine(wrap_device=lambda source: SharedBudgetSource(source, member))
        reclaimer = upkeep(engine)
        a_run_reloaded_and_given_back(engine)
        grant = budget - engine.pool.stats().held_bytes - GROUP_BYTES  # another engine takes all but a group
        assert other.acquire(grant)
        reclaimer.tick()
        assert engine.pool.stats().reserve_bytes == GROUP_BYTES  # the account's room, not the run's three groups
        assert member.info().mapped_bytes + other.info().mapped_bytes <= budget
        other.release(grant)
        close(engine)


def test_the_reserve_for_reloads_goes_first_when_other_engines_wait():
    engine = make_engine()
    pressure = types.SimpleNamespace(pressure_bytes=0)
    reclaimer = upkeep(engine, account=pressure)
    a_run_reloaded_and_given_back(engine)
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == 3 * GROUP_BYTES
    pressure.pressure_bytes = PAGE
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == PAGE  # only the usual reserve, within the room there is
    pressure.pressure_bytes = 0
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == 3 * GROUP_BYTES
    close(engine)


def test_the_reserve_for_reloads_is_given_back_when_idle_and_when_the_run_ages_out():
    engine = make_engine()
    reclaimer = upkeep(engine)
    a_run_reloaded_and_given_back(engine)
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == 3 * GROUP_BYTES
    engine.bp.free_blocks(engine.bp.get_new_blocks(1))  # busy again, just now
    engine.clock.offset = 70.0  # within the TTL (busy), past the runs' minute
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == PAGE
    engine.clock.offset = TTL + 80.0
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == 0
    close(engine)


def test_every_host_tier_brings_a_reserve_for_reloads_of_at_most_two_gib_and_a_zero_cap_keeps_the_usual():
    engine = make_engine(cap_bytes=0)
    reloads = _reload_reserve(engine.manager, engine.cache)
    assert reloads is not None and reloads.cap_bytes == MAX_BYTES == 2 << 30
    assert _reload_reserve(None, engine.cache) is None  # no host tier, nothing reloads
    reclaimer = upkeep(engine)
    a_run_reloaded_and_given_back(engine)
    reclaimer.tick()
    assert engine.pool.stats().reserve_bytes == PAGE
    close(engine)


def test_the_wanted_bytes_are_whole_groups_at_most_the_cap_and_what_the_host_tier_holds():
    cache = types.SimpleNamespace(blocks_per_group=BLOCKS_PER_GROUP, group_bytes=GROUP_BYTES)
    runs = HostRuns()
    for _ in range(RUN):
        runs.hit()
    runs.end()
    held = [10 * BLOCKS_PER_GROUP]
    reserve = ReloadReserve(runs, cache, lambda: held[0], cap_bytes=8 * GROUP_BYTES)
    assert reserve.bytes_wanted(runs._clock()) == 3 * GROUP_BYTES
    reserve.cap_bytes = 2 * GROUP_BYTES + GROUP_PAGES  # not a whole group: the cap still holds
    assert reserve.bytes_wanted(runs._clock()) == 2 * GROUP_BYTES + GROUP_PAGES
    reserve.cap_bytes = 8 * GROUP_BYTES
    held[0] = BLOCKS_PER_GROUP  # the tier was cleared but for a group: no longer run can come back
    assert reserve.bytes_wanted(runs._clock()) == GROUP_BYTES
    held[0] = 0
    assert reserve.bytes_wanted(runs._clock()) == 0


def test_a_reload_of_parked_groups_keeps_the_blocks_of_others_exact():
    """Two runs spilled, the reserve parked for the longer; reloading both gives every block its data."""
    engine = make_engine()
    reclaimer = upkeep(engine)
    first = spill_a_run(engine, "a")
    reload(engine, first)
    spill_again_and_give_back(engine)
    reclaimer.tick()
    second = spill_a_run(engine, "b", n=BLOCKS_PER_GROUP)
    reload(engine, first)  # each checked exact as it comes back
    reload(engine, second)
    close(engine)



def test_regrowing_the_reserve_takes_the_pools_lock_one_page_group_at_a_time(monkeypatch):
    """Regrowing a reload's reserve (2 GiB on the GPU: hundreds of driver calls) holds the pool's lock
    for one chunk of pages at a time, so a map on another thread (the mapper's, which the scheduler
    may wait on) gets through between chunks instead of after the whole growth."""
    import kvelastic.pool.reserve_growth as growth_module

    engine = make_engine()
    reclaimer = upkeep(engine)
    a_run_reloaded_and_given_back(engine)
    monkeypatch.setattr(growth_module, "GROW_CHUNK_BYTES", GROUP_BYTES)
    pool = engine.pool
    created_per_call: list[int] = []
    created = 0
    original_create, original_grow = pool.backend.create_page, pool.grow_reserve
    far_group = engine.cache.num_groups - 1  # not among the lowest unmapped groups the reserve parks at

    def create_page(nbytes):
        nonlocal created
        created += 1
        return original_create(nbytes)

    def grow_reserve(pages):
        before = created
        added = original_grow(pages)
        created_per_call.append(created - before)
        if len(created_per_call) == 1:  # between the first chunk and the next: the lock must be free
            other = threading.Thread(target=pool.map_groups, args=([far_group],))
            other.start()
            other.join(5)
            assert not other.is_alive() and pool.is_mapped(far_group)
        return added

    monkeypatch.setattr(pool.backend, "create_page", create_page)
    monkeypatch.setattr(pool, "grow_reserve", grow_reserve)
    reclaimer.tick()
    assert created_per_call[0] == GROUP_PAGES and max(created_per_call) <= GROUP_PAGES
    grown = created - GROUP_PAGES  # the other thread's map created one group's pages too
    assert grown == 3 * GROUP_PAGES
    assert pool.stats().reserve_bytes == 3 * GROUP_BYTES and len(pool.parked_groups()) == 3
    pool.unmap_groups([far_group])
    close(engine)


def test_while_requests_run_the_reserve_grows_a_step_a_tick_and_between_them_the_rest():
    """Growth at once beside a running request cost it time with no lock wait to show for it: while
    blocks are being allocated the tick grows ``busy_step_bytes`` (``reclaimer.BUSY_STEP_BYTES``),
    and the first tick after the engine's last allocation grows what is missing."""
    import time

    import kvelastic.scheduler.reclaimer as reclaimer_module

    chunk = GROUP_PAGES // 2
    engine = make_engine(busy_step_bytes=chunk * PAGE)
    reclaimer = upkeep(engine)
    a_run_reloaded_and_given_back(engine)
    start = time.monotonic()
    engine.bp.free_blocks(engine.bp.get_new_blocks(1))  # a running request's allocation
    assert engine.queue.last_allocation >= start
    created = [engine.pool.stats().pages_created]
    for _ in range(2):  # blocks were allocated lately: a chunk a tick (the pages the tick recycles aside)
        reclaimer.tick()
        created.append(engine.pool.stats().pages_created)
    assert [b - a for a, b in zip(created, created[1:])] == [chunk, chunk]
    assert engine.pool.stats().reserve_bytes < 3 * GROUP_BYTES
    engine.clock.offset += 2 * reclaimer_module.PACED_WITHIN_S  # nothing allocated since
    reclaimer.tick()
    assert engine.pool.stats().pages_created - created[-1] > chunk  # the rest at once
    assert engine.pool.stats().reserve_bytes == 3 * GROUP_BYTES and len(engine.pool.parked_groups()) == 3
    close(engine)


def test_the_reserve_does_not_grow_while_the_mapper_has_maps_to_make(monkeypatch):
    """Growing is never urgent and a map may be what the scheduler waits for (an idle engine's reload
    maps its groups one by one): while the mapper thread has work, the tick grows nothing; the next
    tick after it grows the rest."""
    engine = make_engine()
    reclaimer = upkeep(engine)
    a_run_reloaded_and_given_back(engine)
    mapper, cache = engine.queue.mapper, engine.cache
    release, entered = threading.Event(), threading.Event()
    original = cache.map_as_many

    def slow_map(groups, *, force=False):  # the mapper thread busy with a map, before the pool's lock
        entered.set()
        assert release.wait(5)
        return original(groups, force=force)

    monkeypatch.setattr(cache, "map_as_many", slow_map)
    mapper.start()
    try:
        far_group = cache.num_groups - 1
        mapper.request_map([far_group])
        assert entered.wait(5) and mapper.busy()
        before = engine.pool.stats().reserve_bytes
        reclaimer.tick()
        assert engine.pool.stats().reserve_bytes == before  # nothing grown beside the map
        release.set()
        mapper.map_now([])  # the map done
        assert not mapper.busy() and engine.pool.is_mapped(far_group)
        reclaimer.tick()
        assert engine.pool.stats().reserve_bytes == 3 * GROUP_BYTES
    finally:
        release.set()
        mapper.stop()
    engine.pool.unmap_groups([far_group])
    close(engine)
