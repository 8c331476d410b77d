"""Sleep and wake of an engine whose KV pages kvelastic holds, on vLLM's real scheduler (every band).

vLLM's sleep (levels 1 and 2) and ``release_kv_cache_memory`` reset the prefix cache and
then, through kvelastic's engine-core wraps (``patches/sleep_mode.py``), call the
scheduler's hibernation. Here the scheduler is vLLM's own over a host-backed pool that
joined a shared account, so what is mapped and held is the pool's real bookkeeping; the
engine core's own calls are run in ``test_sleep_mode.py`` (0.29+).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.errors import PoolLimitExceeded  # noqa: E402
from kvelastic.patches.sleep_mode import HIBERNATION_ATTRIBUTE  # noqa: E402
from tests.kv_fixtures import GROUP_BYTES  # noqa: E402
from tests.scheduler_harness import (blocks_in_use_are_all_mapped, cached_blocks_are_all_mapped, drive,  # noqa: E402
                                     make_requests, make_scheduler, scheduler_lock)
from tests.test_real_scheduler import patched  # noqa: E402, F401 (a fixture)


def wave(tag: str) -> list:
    """Four prompts of 20 blocks each, none shared: 80 blocks at once, over three groups at least."""
    return make_requests(tag, 4, 320, 0, seed=1)


def reset(scheduler) -> None:
    with scheduler_lock(scheduler):
        assert scheduler.reset_prefix_cache()


def test_asleep_the_engine_holds_only_the_null_blocks_group_and_awake_it_serves_as_vanilla(patched):
    scheduler, pool, _ = patched(shared=True, cache_ttl_s=math.inf)  # nothing idles out by itself
    hibernation = getattr(scheduler, HIBERNATION_ATTRIBUTE)
    first = drive(scheduler, [wave("a")])
    assert pool.stats().held_bytes >= 3 * GROUP_BYTES
    reset(scheduler)  # what vLLM does before it sleeps

    assert hibernation.sleep() == GROUP_BYTES == pool.stats().held_bytes
    assert pool.mapped_groups() == frozenset({0}) and hibernation.asleep
    scheduler.kvelastic_reclaimer.tick()  # the upkeep runs no job while asleep: no reserve, no new limit
    assert pool.stats().held_bytes == GROUP_BYTES

    with pytest.raises(PoolLimitExceeded):  # asleep, no group maps (vLLM schedules nothing meanwhile)
        pool.map_groups([1])

    hibernation.wake()
    assert not hibernation.asleep
    again = drive(scheduler, [wave("b")], after_step=lambda s: blocks_in_use_are_all_mapped(s, pool) or pytest.fail(
        "a block in use lies in an unmapped group"))
    vanilla = make_scheduler()
    expected = drive(vanilla, [wave("a")])
    assert vanilla.reset_prefix_cache()
    assert first == expected and again == drive(vanilla, [wave("b")])


def test_sleep_evicts_what_vllm_left_cached_and_a_second_sleep_or_wake_changes_nothing(patched):
    """Before 0.17 the engine core's sleep does not reset the prefix cache (``LLM.sleep`` does): what is
    cached outside the null block's group is evicted from vLLM's map, so no later lookup hits a block whose
    page is gone (blocks cached in that group keep their page)."""
    scheduler, pool, _ = patched(cache_ttl_s=math.inf)
    hibernation = getattr(scheduler, HIBERNATION_ATTRIBUTE)
    drive(scheduler, [wave("a")])
    block_pool = scheduler.kv_cache_manager.block_pool
    assert len(block_pool.cached_block_hash_to_block) > 0

    cached = len(block_pool.cached_block_hash_to_block)
    hibernation.sleep()
    assert pool.mapped_groups() == frozenset({0}) and cached_blocks_are_all_mapped(scheduler, pool)
    assert len(block_pool.cached_block_hash_to_block) < cached
    assert hibernation.sleep() == GROUP_BYTES  # asleep already
    hibernation.wake()
    hibernation.wake()  # awake already
    limit = pool.stats().limit_bytes
    assert limit is None or limit > GROUP_BYTES
    assert drive(scheduler, [wave("b")])  # serves again, every block it hits mapped
    assert cached_blocks_are_all_mapped(scheduler, pool)


def test_sleep_drops_the_host_tiers_copies_even_where_vllm_did_not_reset(patched):
    """An RL loop loads new weights while the engine sleeps: no KV of the old ones may come back from the
    host tier after wake. Before 0.17 the engine core's own sleep resets nothing (the front ends do), and
    the hibernation's eviction spills what was cached: the hibernation drops the host copies itself."""
    scheduler, pool, _ = patched(cache_ttl_s=math.inf, cpu_bytes=16 * GROUP_BYTES)
    hibernation = getattr(scheduler, HIBERNATION_ATTRIBUTE)
    tier = scheduler.kvelastic_offload.tier
    first = drive(scheduler, [wave("a")])
    assert len(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block) > 0  # no reset before sleep

    hibernation.sleep()
    assert tier.stats().slots_used == 0 and pool.mapped_groups() == frozenset({0})
    hibernation.wake()
    hits = tier.stats().hits
    again = drive(scheduler, [wave("a")])
    assert tier.stats().hits == hits  # none of the prompts came back from the host
    assert sum(n for step in again for _, n in step) > sum(n for step in first for _, n in step) / 2  # recomputed


def test_while_one_engine_sleeps_the_other_uses_its_memory_and_it_comes_back_on_wake(patched):
    """Two engines in one GPU account of 6 groups: ``a`` holds most of it when it goes to sleep; ``b``'s wave,
    which needs the whole budget, then runs on everything but ``a``'s null group. Awake again, ``a`` gets its
    memory back from an idle ``b`` (at least down to ``b``'s fair share) and serves. Together they never hold
    more than the budget."""
    from tests.test_fair_share_schedulers import _step

    budget = 6 * GROUP_BYTES
    settings = dict(shared=True, shared_budget_bytes=budget, cache_ttl_s=math.inf, reserve_bytes=0)
    a, a_pool, _ = patched(name="a", **settings)
    b, b_pool, _ = patched(name="b", **settings)

    def run(engine, wave, held_by_b: list) -> None:
        for request in wave:
            engine.add_request(request)
        for _ in range(600):
            if not engine.has_requests():
                return
            _step(engine)
            a.kvelastic_reclaimer.tick()
            b.kvelastic_reclaimer.tick()
            together = a_pool.stats().held_bytes + b_pool.stats().held_bytes
            assert together <= budget, f"the engines hold {together} bytes together"
            held_by_b.append(b_pool.stats().held_bytes)
        pytest.fail("a wave never finished")

    run(a, make_requests("a", 8, 460, 0, seed=3, max_tokens=20), [])
    assert a_pool.stats().held_bytes > budget // 2  # a's cached wave keeps most of the budget
    assert getattr(a, HIBERNATION_ATTRIBUTE).sleep() == GROUP_BYTES

    held_by_b: list[int] = []
    run(b, make_requests("b", 8, 460, 0, seed=4, max_tokens=20), held_by_b)
    assert max(held_by_b) == budget - GROUP_BYTES  # all of it but a's null group

    getattr(a, HIBERNATION_ATTRIBUTE).wake()
    held_by_b.clear()
    run(a, make_requests("c", 8, 460, 0, seed=5, max_tokens=20), held_by_b)
    # b's idle cache went back to a: all of it, or (b was refused within the want's 5 s) down to b's fair share
    assert min(held_by_b) <= budget // 2 < max(held_by_b)
