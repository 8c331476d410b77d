"""Spill to the host tier and reload on a prefix hit, through vLLM's real BlockPool (host backend)."""

from __future__ import annotations

import types

import pytest
import torch

from kvelastic.hooks.local_connection import LocalConnection
from kvelastic.hooks.offload_setup import block_views, local_host_tier, wire_offload
from kvelastic.offload.copier import BlockCopier
from kvelastic.hooks.scheduler import _attach_offload
from kvelastic.offload.host_tier import HostTier
from kvelastic.settings import Settings
from tests.host_plans import BESIDE_A_CONNECTOR as IN_FRONT
from tests.scheduler_harness import scheduler_patcher
from tests.test_page_aware_block_pool import BS, StandInRequest, build

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")


def _stamp(views, block_id: int, value: int) -> None:
    for view in views:
        view[:, block_id].fill_(value)


def _read(views, block_id: int) -> list[int]:
    return sorted({int(v) for view in views for v in view[:, block_id].unique()})


def test_host_tier_admits_once_and_frees_slots_on_eviction():
    tier = HostTier(4 * 1024, 1024, pin=False)
    slots = [tier.admit(k) for k in "abcd"]
    assert sorted(slots) == [0, 1, 2, 3]
    assert tier.admit("a") is None  # already held: no copy needed
    assert tier.lookup("a") == slots[0] and tier.lookup("zz") is None
    tier.admit("e")  # full: ARC evicts one key and its slot is reused
    assert tier.stats().slots_used == 4 and tier.evicted == 1
    assert len({tier.lookup(k) for k in "abcde" if k in tier}) == 4
    tier.clear()
    assert tier.stats().slots_used == 0 and "a" not in tier


def test_copier_round_trip_on_cpu():
    blocks = [torch.arange(8 * 16, dtype=torch.int8).view(8, 16), torch.full((8, 4), 3, dtype=torch.int8)]
    host = torch.zeros((5, 20), dtype=torch.int8)
    copier = BlockCopier(blocks, host)
    copier.store([2, 5], [4, 0]).wait()
    assert torch.equal(host[4, :16], blocks[0][2]) and torch.equal(host[0, :16], blocks[0][5])
    blocks[0][1].zero_()
    copier.load([1], [4])
    assert torch.equal(blocks[0][1], blocks[0][2]) and int(blocks[1][1, 0]) == 3
    with pytest.raises(ValueError):
        BlockCopier(blocks, torch.zeros((5, 7), dtype=torch.int8))
    assert copier.copy_times() is None  # synchronous CPU copies: no GPU time to report


def test_the_log_line_gives_the_copies_gpu_time_and_rate_where_the_copier_measures_them():
    from kvelastic.scheduler.engine_report import StatsLog

    pool = types.SimpleNamespace(stats=lambda: types.SimpleNamespace(mapped_bytes=1 << 30, held_bytes=1 << 30,
                                                                      limit_bytes=2 << 30), lock_waits=lambda: None)
    base = {"host_bytes_used": 0, "host_hits": 3, "host_misses": 1, "spilled_bytes": 0, "reloaded_bytes": 0,
            "arc_p": 0.0}
    timed = dict(base, store_seconds=0.5, load_seconds=0.0, store_timed_bytes=20e9, load_timed_bytes=0.0)
    cache = types.SimpleNamespace(pool=pool)
    line = StatsLog(cache, types.SimpleNamespace(stats=lambda: timed)).line()  # type: ignore[arg-type]
    assert line.endswith("; copies on the GPU: spill 0.50 s (40.0 GB/s), reload 0.00 s (-)")
    assert "copies on the GPU" not in StatsLog(cache, types.SimpleNamespace(stats=lambda: base)).line()



@pytest.mark.parametrize("policy", ["arc", "lru"])
def test_reclaimed_prefix_comes_back_from_the_host_with_its_data(policy):
    reclaimed_prefix_comes_back(policy, "direct")  # a CPU's copier: the kernels' stand-in


def reclaimed_prefix_comes_back(policy: str, path: str) -> None:
    """Blocks of a released group, spilled to the tier as the patch wires it, come back on lookups."""
    pool, views, cache, bp, queue = build(limit_groups=None)
    slot_bytes = sum(v.shape[1] for v in block_views(cache))
    settings = Settings(cpu_bytes=64 * slot_bytes, cpu_policy=policy)
    scheduler = types.SimpleNamespace()
    manager = _attach_offload(scheduler, bp, queue, LocalConnection(cache, None), settings,  # as the patch does
                              IN_FRONT, scheduler_patcher())
    copier = getattr(manager.copier, "inner", manager.copier)  # write-through (the cache in process) wraps it
    assert scheduler.kvelastic_offload is manager and copier.path == path
    assert type(manager.tier.policy).__name__ == policy.upper()
    blocks = bp.get_new_blocks(40)
    for i, block in enumerate(blocks):
        _stamp(views, block.block_id, i % 90 + 1)
    hashes = [b"h%d" % i for i in range(40)]
    bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, 40, BS, 0)
    old_ids = [b.block_id for b in blocks]
    bp.free_blocks(blocks)
    released = queue.reclaim_cached(groups_wanted=10)
    assert released >= 1
    gone = [i for i, bid in enumerate(old_ids) if cache.group_of_block(bid) != 0]
    assert manager.counters.spilled_blocks == len(gone)
    for i in gone:  # the GPU lost them; the lookup reloads them into fresh blocks
        found = bp.get_cached_block(hashes[i], [0])
        assert found is not None
    manager.flush()
    for i in gone:
        block = bp.get_cached_block(hashes[i], [0])[0]
        assert _read(views, block.block_id) == [i % 90 + 1]
    assert manager.tier.hits == len(gone) and manager.counters.reloaded_blocks == len(gone)
    assert bp.get_cached_block(b"never", [0]) is None
    pool.close()


def test_blocks_evicted_under_pressure_are_spilled_before_reuse():
    pool, views, cache, bp, queue = build(limit_groups=2)
    manager = wire_offload(bp, queue, *local_host_tier(cache, 1 << 20, "arc", IN_FRONT), scheduler_patcher(),
                           IN_FRONT)
    first = bp.get_new_blocks(30)
    for i, block in enumerate(first):
        _stamp(views, block.block_id, 7)
    bp.cache_full_blocks(StandInRequest([b"p%d" % i for i in range(30)]), first, 0, 30, BS, 0)
    bp.free_blocks(first)
    second = bp.get_new_blocks(bp.get_num_free_blocks())  # uses every block: cached ones are evicted
    assert manager.counters.spilled_blocks == 30
    manager.flush()  # the end of the scheduling step: spills are issued before the step's compute
    for block in second:
        _stamp(views, block.block_id, 9)  # new requests overwrite the evicted blocks
    bp.free_blocks(second[:10])
    found = bp.get_cached_block(b"p3", [0])
    manager.flush()
    assert found is not None and _read(views, found[0].block_id) == [7]
    pool.close()


def test_loads_under_full_memory_evict_unmatched_cached_blocks_only():
    pool, views, cache, bp, queue = build(limit_groups=1)  # one group: 31 usable blocks
    manager = wire_offload(bp, queue, *local_host_tier(cache, 1 << 20, "arc", IN_FRONT), scheduler_patcher(),
                           IN_FRONT)
    old = bp.get_new_blocks(31)
    for block in old:
        _stamp(views, block.block_id, 5)
    bp.cache_full_blocks(StandInRequest([b"o%d" % i for i in range(31)]), old, 0, 31, BS, 0)
    bp.free_blocks(old)
    queue.reclaim_cached(groups_wanted=1)  # group 0 holds the null block: nothing is released
    newer = bp.get_new_blocks(31)  # evicts (and spills) all 31 cached blocks
    manager.flush()
    for block in newer:
        _stamp(views, block.block_id, 6)
    bp.cache_full_blocks(StandInRequest([b"n%d" % i for i in range(31)]), newer, 0, 31, BS, 0)
    bp.free_blocks(newer)
    hit = bp.get_cached_block(b"n0", [0])[0]  # matched on the GPU, not yet touched
    loaded = bp.get_cached_block(b"o0", [0])[0]  # memory is full: a load must evict something
    assert loaded.block_id != hit.block_id
    assert bp.get_cached_block(b"n0", [0])[0] is hit  # the matched block kept its hash
    manager.flush()
    assert _read(views, loaded.block_id) == [5] and _read(views, hit.block_id) == [6]
    pool.close()
