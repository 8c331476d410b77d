"""vLLM's offload connectors on the elastic pool: vLLM's real scheduler and each connector's real scheduler side.

Every mode the installed vLLM ships (SimpleCPUOffloadConnector eager, lazy and,
from 0.28, disk; OffloadingConnector lru and arc) runs over a host-backed elastic cache, with the
connector's worker stood in for (``tests/connector_harness.py``). Checked: the
same steps as the same connector on vanilla vLLM with memory to spare, a
prefix loaded back by the connector after vLLM's prefix cache was dropped;
under a tight physical limit blocks are stored, evicted and loaded back and
every request finishes; after every step each GPU block a transfer may still be
copying lies in a mapped group that kvelastic will not release (in use, or held
for the connector); an idle engine gives its memory back and a prefix the
connector stored survives it.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.errors import KvelasticError  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from tests.connector_harness import BS, MODES, Transfers, drive_with_connector, make_connector_scheduler  # noqa: E402
from tests.kv_fixtures import GROUP_BYTES, build_cache  # noqa: E402
from tests.scheduler_harness import build_patched, check_every_step, make_requests, prefill, wait_unmapped  # noqa: E402


def _installed_modes() -> list[str]:
    from importlib.util import find_spec

    simple = find_spec("vllm.v1.simple_kv_offload") is not None
    disk = simple and find_spec("vllm.v1.simple_kv_offload.disk_backend") is not None  # from 0.28
    return [m for m in MODES if (simple or not m.startswith("simple")) and (disk or m != "simple-disk")]


@pytest.fixture
def elastic(tmp_path, monkeypatch):
    """Patched schedulers with a connector over host-backed caches; stopped and reverted after the test."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    made: list = []

    def make(mode: str, limit_groups: int | None = None, **settings):
        from kvelastic.startup.runtime import Runtime

        pool, views, cache = build_cache(limit_groups)
        runtime = Runtime(Settings(enabled=True, limit_bytes=limit_groups and limit_groups * GROUP_BYTES,
                                   **settings))
        runtime.cache = cache
        try:
            scheduler, patcher = build_patched(runtime, lambda: make_connector_scheduler(mode))
        except BaseException:
            pool.close()
            raise
        made.append((scheduler, pool, views, patcher))
        return scheduler, pool

    yield make
    for scheduler, pool, _, patcher in made:
        scheduler.kvelastic_reclaimer.stop()
        scheduler.kv_cache_manager.block_pool.free_block_queue.mapper.stop()
        patcher.revert()
        pool.close()


def fenced(pool):
    """After each step: every GPU block a transfer may be copying is in a mapped group kvelastic keeps."""
    mapped_everywhere = check_every_step(pool)

    def check(scheduler, transfers: Transfers) -> None:
        mapped_everywhere(scheduler)
        queue = scheduler.kv_cache_manager.block_pool.free_block_queue
        for block_id in transfers.gpu_blocks_in_flight():
            group = queue.cache.group_of_block(block_id)
            assert pool.is_mapped(group), f"block {block_id} is copied while its group {group} is unmapped"
            in_use = scheduler.kv_cache_manager.block_pool.blocks[block_id].ref_cnt > 0
            assert in_use or group in queue.free.held, f"block {block_id} is copied but its group may be released"

    return check


def _reset_gpu_cache(scheduler) -> None:
    """Drop vLLM's GPU prefix cache but keep the connector's copies: the next wave loads from it."""
    assert scheduler.reset_prefix_cache(False, False)


def _waves():
    return [make_requests("a", 4, 320, 320, seed=0), make_requests("b", 4, 320, 320, seed=0)]


@pytest.mark.parametrize("mode", _installed_modes())
def test_with_memory_to_spare_the_connector_makes_the_same_steps_as_on_vanilla(elastic, mode):
    vanilla_transfers, transfers = Transfers(), Transfers()
    vanilla = drive_with_connector(make_connector_scheduler(mode), _waves(), vanilla_transfers,
                                   between_waves=_reset_gpu_cache)
    # A cached prefix idle past its TTL is evicted by the upkeep thread: on a machine slow enough to spend
    # that long between two steps the comparison would hinge on the wall clock, so here nothing idles out.
    scheduler, pool = elastic(mode, cache_ttl_s=math.inf)
    assert type(scheduler.kv_cache_manager.block_pool.free_block_queue).__name__ == "PageAwareFreeQueue"
    trace = drive_with_connector(scheduler, _waves(), transfers, between_waves=_reset_gpu_cache,
                                 after_step=fenced(pool))
    assert trace == vanilla
    if mode != "simple-lazy":  # lazy mode stores blocks as its walk of the free queue reaches them
        assert (transfers.stored_blocks, transfers.loaded_blocks) == (vanilla_transfers.stored_blocks,
                                                                      vanilla_transfers.loaded_blocks)
        assert transfers.loaded_blocks >= 19 and prefill(trace, "b") < prefill(trace, "a") / 4


@pytest.mark.parametrize("mode", _installed_modes())
def test_under_a_tight_limit_blocks_are_stored_evicted_and_loaded_back(elastic, mode):
    """a, then unrelated work that evicts a's blocks from the 3 groups the limit allows, then a again."""
    scheduler, pool = elastic(mode, limit_groups=3)
    transfers = Transfers()
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
    waves = [make_requests("a", 4, 320, 320, seed=0), *filler, make_requests("b", 4, 320, 320, seed=0)]
    trace = drive_with_connector(scheduler, waves, transfers, after_step=fenced(pool))
    expected = {f"{w}-{i}" for w in "ab" for i in range(4)} | {f"f{k}-{i}" for k in range(3) for i in range(4)}
    assert {rid for step in trace for rid, _ in step} == expected and not scheduler.has_requests()
    assert pool.stats().mapped_bytes <= 4 * GROUP_BYTES  # the limit, and at most one group past it
    assert transfers.stored_blocks >= 19 and transfers.loaded_blocks >= 19
    assert prefill(trace, "b") < prefill(trace, "a") / 4  # b's prompts came back from the connector


@pytest.mark.parametrize("mode", _installed_modes())
def test_an_idle_engine_gives_memory_back_and_the_connectors_copies_survive(elastic, mode):
    scheduler, pool = elastic(mode, limit_groups=6, cache_ttl_s=0.0)
    transfers = Transfers()
    check = fenced(pool)
    lazy = mode == "simple-lazy"
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)] if lazy else []
    drive_with_connector(scheduler, [make_requests("a", 4, 320, 0, seed=0), *filler], transfers, after_step=check)
    busy = pool.stats().mapped_bytes
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    with scheduler.kvelastic_reclaimer.lock:
        queue.set_idle()
        queue.reclaim_cached(idle_before=float("inf"))
    assert not queue.free.held  # nothing in flight: nothing held
    assert wait_unmapped(pool, GROUP_BYTES) <= GROUP_BYTES < busy  # only the null block's group stays
    stored = transfers.stored_blocks
    loaded = transfers.loaded_blocks
    trace = drive_with_connector(scheduler, [make_requests("b", 4, 320, 0, seed=0)], transfers, after_step=check)
    reloaded = transfers.loaded_blocks - loaded
    assert stored >= 19 and reloaded >= 19  # from groups that were unmapped
    if lazy and _lazy_walk_starts_at_the_head():
        # 0.34's lazy mode stores only the blocks within its target of the free queue's head, where it puts
        # back what it stored: the idle engine's reclaim drops the rest of a's cached blocks unstored (vLLM
        # keeps them on the GPU). What was stored comes back and is not computed again.
        assert prefill(trace, "b") <= 4 * 320 - BS * reloaded
    else:
        assert prefill(trace, "b") < 4 * 320 / 4


def _lazy_walk_starts_at_the_head() -> bool:
    """SimpleCPUOffload's lazy walk restarts at the free queue's head each step from 0.34 (a cursor before)."""
    from kvelastic.patching.versions import Version, installed_vllm_version

    return installed_vllm_version() >= Version.parse("0.34")


def test_offloading_connector_groups_freed_while_it_is_busy_are_held_until_it_is_done(elastic):
    """OffloadingConnector lets vLLM free blocks a store may still read (or is yet to plan, for a request
    that just finished); their groups are not released until it has nothing in flight."""
    scheduler, pool = elastic("offload-lru", limit_groups=6)
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    held: list[int] = []

    def watch(sched, transfers: Transfers) -> None:
        fenced(pool)(sched, transfers)
        held.append(len(queue.free.held))
        with sched.kvelastic_reclaimer.lock:  # the reclaimer, idle or pressed, releases no held group
            for group in queue.free.held:
                assert group not in [g for _, g in queue.free.cache_only_groups()]

    requests = [make_requests("a", 4, 320, 0, seed=0), make_requests("b", 4, 320, 0, seed=1)]
    drive_with_connector(scheduler, requests, Transfers(), after_step=watch)
    assert max(held) > 0  # the finished requests' blocks, freed before their last stores were done
    with scheduler.kvelastic_reclaimer.lock:
        queue.reclaim_cached(idle_before=float("inf"))
    assert not queue.free.held


@pytest.mark.parametrize("mode", ["simple-eager", "offload-arc"])
def test_kvelastics_host_tier_beside_a_vllm_offload_connector_is_refused(elastic, mode):
    if mode not in _installed_modes():
        pytest.skip("this vLLM has no SimpleCPUOffloadConnector")
    with pytest.raises(KvelasticError, match="KVELASTIC_CPU_BYTES .* would both offload"):
        elastic(mode, cpu_bytes=16 * GROUP_BYTES)
