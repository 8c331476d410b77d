"""A hybrid model (attention and Mamba-2 layers) with prefix caching on, vLLM 0.29+'s real Scheduler.

The two KV cache groups share one vLLM BlockPool: a block id names the same
bytes of the one backing for an attention layer or a Mamba layer, whichever
group holds it. vLLM's own planner lays both out in one backing, kvelastic's
one-backing patches allocate it from a host-backed page pool, and
``scheduler_block_pool`` patches the scheduler. Mamba prefix caching is on the
way the installed release offers it: ``mamba_cache_mode="align"`` (vLLM 0.33
and 0.34 offer only "none" and "align"), where vLLM caches a Mamba state at
block boundaries and splits prefills there, so a hit needs the attention
blocks and the Mamba state block of one prefix.

Checked, against a vanilla Scheduler on the same plan and requests: the
scheduled tokens of every step and each request's prefix-cache hit tokens;
every step, each block a request holds and each block vLLM could serve as a
hit lies in a mapped page group; after the run the memory goes back, on a
prefix-cache reset and on an idle engine, and vLLM's map never keeps a hit in
an unmapped group.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.29+ (one KV backing)")

from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvelastic.settings import Settings  # noqa: E402
from tests.kv_fixtures import BS, N  # noqa: E402
from tests.scheduler_harness import (PatchedSchedulers, cached_blocks_are_all_mapped, check_every_step,  # noqa: E402
                                     drive, make_requests, make_scheduler, repeat_waves, scheduler_lock,
                                     vllm_config, wait_unmapped)
from tests.test_single_backing import BandC, _hybrid_groups, plan  # noqa: E402
from tests.test_single_backing_scheduler import LAYOUTS, PAGE, published  # noqa: E402
TTL = 3600.0  # longer than any run: nothing idles out while the schedules are compared


def hybrid_groups() -> list:
    """``_hybrid_groups``'s attention and Mamba-2 layers, the Mamba group caching in "align" mode."""
    attention, mamba = _hybrid_groups()
    assert isinstance(mamba.kv_cache_spec, MambaSpec)
    spec = dataclasses.replace(mamba.kv_cache_spec, mamba_cache_mode="align")
    return [attention, dataclasses.replace(mamba, kv_cache_spec=spec)]


def hybrid_config():
    """The harness's engine config (prefix caching on) with vLLM's Mamba prefix caching on as well."""
    config = copy.deepcopy(vllm_config(N))
    assert config.cache_config.enable_prefix_caching
    config.cache_config.mamba_cache_mode = "align"
    return config


@pytest.fixture
def hybrid(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    schedulers = PatchedSchedulers()
    envs: list[BandC] = []

    def make(layout: KVCacheLayout, **settings):
        kv_config = plan(layout, hybrid_groups(), N)
        views, pool, cache = published(kv_config, layout, envs)
        scheduler = schedulers.make(pool, views, cache, Settings(enabled=True, chunk_bytes=PAGE, **settings),
                                    kv_cache_config=kv_config, config=hybrid_config())
        return scheduler, pool, cache, kv_config

    yield make
    schedulers.close()
    for env in envs:
        env.close()


def run(scheduler, waves: list[list], after_step=None) -> tuple[list, dict]:
    """The scheduled tokens of every step, and each request's prefix-cache hit tokens: the computed tokens
    vLLM tells the workers a request starts from, each time it is scheduled afresh."""
    hits: dict[str, list[int]] = {}

    def note_hits(_, out) -> None:
        for new in out.scheduled_new_reqs:
            hits.setdefault(new.req_id, []).append(new.num_computed_tokens)

    return drive(scheduler, waves, after_step=after_step, forward=note_hits), hits


def fewest_free(low: list):
    """An ``after_step`` that notes the fewest free blocks vLLM's pool reported."""
    return lambda scheduler: low.append(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def release(scheduler, pool, cache, idled_s: float = 2.0) -> int:
    """Tell the upkeep the engine idled for ``idled_s``, run it once, and wait for the unmaps."""
    scheduler.kv_cache_manager.block_pool.free_block_queue.last_allocation -= idled_s
    scheduler.kvelastic_reclaimer.tick()
    return wait_unmapped(pool, cache.group_bytes)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_the_hybrid_schedule_and_its_prefix_hits_are_vanillas_and_a_reset_gives_the_memory_back(hybrid, layout):
    scheduler, pool, cache, kv_config = hybrid(layout, cache_ttl_s=TTL)
    coordinator = scheduler.kv_cache_manager.coordinator
    assert [type(m).__name__ for m in coordinator.single_type_managers] == ["FullAttentionManager", "MambaManager"]
    assert scheduler.need_mamba_block_aligned_split  # vLLM's Mamba prefix caching is on
    low: list[int] = []
    vanilla_trace, vanilla_hits = run(make_scheduler(kv_cache_config=kv_config, config=hybrid_config()),
                                      repeat_waves(), after_step=fewest_free(low))
    mapped: list[int] = []
    trace, hits = run(scheduler, repeat_waves(), after_step=check_every_step(pool, mapped))
    assert trace == vanilla_trace
    assert hits == vanilla_hits
    waves = repeat_waves()
    # The second wave repeats the first's prompts: each hits up to its last whole block, Mamba state included.
    assert all(hits[r.request_id] == [(r.num_prompt_tokens - 1) // BS * BS] for r in waves[1])
    assert min(low) < N // 8  # the last wave needed most blocks at once
    busy = max(mapped)
    assert busy > (cache.num_groups - 2) * cache.group_bytes  # and kvelastic mapped nearly all groups for it
    with scheduler_lock(scheduler):
        assert scheduler.reset_prefix_cache()
    assert release(scheduler, pool, cache, 2 * TTL) <= cache.group_bytes < busy  # only the null block's group


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_an_idle_hybrid_engine_gives_its_memory_back_and_keeps_no_hit_in_an_unmapped_group(hybrid, layout):
    scheduler, pool, cache, _ = hybrid(layout, cache_ttl_s=0.0, reserve_bytes=0)
    mapped: list[int] = []
    first = repeat_waves()[:2]
    _, warm = run(scheduler, first, after_step=check_every_step(pool, mapped))
    assert all(warm[r.request_id][0] > 0 for r in first[1])  # the cache served hits before the engine idled
    assert release(scheduler, pool, cache) <= cache.group_bytes < max(mapped)
    assert cached_blocks_are_all_mapped(scheduler, pool)  # what vLLM still offers lies in the group kept
    again = make_requests("b", 6, 300, 200, seed=0)  # the prompts the second wave hit
    trace, hits = run(scheduler, [again], after_step=check_every_step(pool))
    assert {rid for step in trace for rid, _ in step} == {r.request_id for r in again}
    assert not scheduler.has_requests()
    assert sum(map(sum, hits.values())) < sum(map(sum, (warm[r.request_id] for r in first[1])))  # hits died
