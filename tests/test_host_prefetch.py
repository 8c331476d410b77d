"""Loads ahead: waiting requests' host-held prefixes come back beside compute, with their data.

Through vLLM's real BlockPool (host backend), then vLLM's real Scheduler with a
stand-in forward pass that checks every block a request reads holds the data
its tokens wrote, and stamps the blocks it writes.
"""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from kvelastic.integration.offload_setup import attach_offload  # noqa: E402
from tests.kv_fixtures import BS, GROUP_BYTES  # noqa: E402
from tests.scheduler_harness import check_every_step, drive, make_requests, prefill  # noqa: E402
from tests.test_offload import _read, _stamp  # noqa: E402
from tests.test_page_aware_block_pool import StandInRequest, build  # noqa: E402
from tests.test_real_scheduler import patched  # noqa: E402,F401 - the fixture


def _cached_then_reclaimed(count: int, value_of=lambda i: i % 90 + 1):
    """A pool whose ``count`` cached blocks went to the host tier when their groups were released."""
    pool, views, cache, bp, queue = build(limit_groups=None)
    manager = attach_offload(bp, queue, cache, cpu_bytes=1 << 20)
    blocks = bp.get_new_blocks(count)
    for i, block in enumerate(blocks):
        _stamp(views, block.block_id, value_of(i))
    hashes = [b"h%d" % i for i in range(count)]
    bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, count, BS, 0)
    bp.free_blocks(blocks)
    queue.reclaim_cached(groups_wanted=10)
    keys = [make_block_hash_with_group_id(h, 0) for h in hashes]
    return pool, views, bp, manager, keys


def test_prefetch_loads_a_prefix_up_to_its_first_unknown_block_within_the_budget():
    pool, views, bp, manager, keys = _cached_then_reclaimed(60)
    on_gpu = [i for i, k in enumerate(keys) if manager.gpu_lookup(k) is not None]
    gone = [i for i, k in enumerate(keys) if manager.gpu_lookup(k) is None]
    assert on_gpu and len(gone) > 20  # group 0 (vLLM's null block) kept its blocks
    unknown = make_block_hash_with_group_id(b"never", 0)
    walked = keys[:gone[10]] + [unknown] + keys[gone[10]:]
    assert manager.prefetch([walked], budget=100) == 10  # stops at the block nobody holds
    assert manager.prefetch([keys], budget=5) == 5  # the budget holds
    assert manager.unused_ahead == 15 and manager.counters.prefetched_blocks == 15
    loaded = gone[:15]
    for i in loaded:
        block = bp.get_cached_block(b"h%d" % i, [0])
        assert block is not None and _read(views, block[0].block_id) == [i % 90 + 1]
    assert manager.unused_ahead == 0  # the scheduler matched them all
    assert manager.tier.hits == 15
    manager.flush()
    pool.close()


def test_prefetch_under_full_memory_never_evicts_the_prefix_it_is_loading():
    pool, views, cache, bp, queue = build(limit_groups=1)  # one group: 31 usable blocks
    manager = attach_offload(bp, queue, cache, cpu_bytes=1 << 20)
    old = bp.get_new_blocks(31)
    for block in old:
        _stamp(views, block.block_id, 5)
    bp.cache_full_blocks(StandInRequest([b"o%d" % i for i in range(31)]), old, 0, 31, BS, 0)
    bp.free_blocks(old)
    newer = bp.get_new_blocks(20)  # evicts (and spills) 20 of the old blocks
    manager.flush()
    for block in newer:
        _stamp(views, block.block_id, 6)
    bp.cache_full_blocks(StandInRequest([b"n%d" % i for i in range(20)]), newer, 0, 20, BS, 0)
    bp.free_blocks(newer)
    keys = [make_block_hash_with_group_id(b"o%d" % i, 0) for i in range(31)]
    resident = {manager.gpu_lookup(k).block_id for k in keys if manager.gpu_lookup(k) is not None}
    assert len(resident) == 11
    assert manager.prefetch([keys], budget=31) == 20  # room made by evicting the n* blocks only
    for i in range(31):
        block = bp.get_cached_block(b"o%d" % i, [0])
        assert block is not None and _read(views, block[0].block_id) == [5]
    assert all(manager.gpu_lookup(make_block_hash_with_group_id(b"n%d" % i, 0)) is None for i in range(20))
    manager.flush()
    pool.close()


def _value(tokens: list[int]) -> int:
    return hashlib.sha256(repr(tokens).encode()).digest()[0] % 100 + 1


def checking_forward(views, errors: list):
    """The stand-in forward pass: read blocks must hold their tokens' value; written blocks get theirs."""

    def forward(scheduler, out) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            start = request.num_computed_tokens - n  # the scheduler already counted this step's tokens
            ids = scheduler.kv_cache_manager.get_block_ids(rid)[0]
            tokens = request.all_token_ids
            for i in range(start // BS):
                want = _value(tokens[i * BS:(i + 1) * BS])
                if _read(views, ids[i]) != [want]:
                    errors.append((rid, i, ids[i], _read(views, ids[i]), want))
            for i in range(start // BS, (start + n - 1) // BS + 1):
                _stamp(views, ids[i], _value(tokens[i * BS:min((i + 1) * BS, start + n)]))

    return forward


def _burst(patched, prefetch_bytes: int):
    """16 prompts, other work that pushes them to the host, the same 16 again: 8 run, 8 wait their turn."""
    scheduler, pool, views = patched(cpu_bytes=32 * GROUP_BYTES, host_prefetch_bytes=prefetch_bytes)
    errors: list = []
    waves = [make_requests("a", 16, 320, 0, seed=0), make_requests("f", 8, 400, 0, seed=9),
             make_requests("b", 16, 320, 0, seed=0)]
    trace = drive(scheduler, waves, after_step=check_every_step(pool), forward=checking_forward(views, errors))
    return scheduler, trace, errors


def test_a_burst_of_waiting_requests_gets_its_prefix_loaded_ahead_with_the_right_data(patched):
    scheduler, trace, errors = _burst(patched, prefetch_bytes=8 * GROUP_BYTES)
    assert errors == []
    offload = scheduler.kvelastic_offload
    assert offload.counters.prefetched_blocks > 0
    assert not scheduler.has_requests()
    assert prefill(trace, "b") < prefill(trace, "a") / 2
    assert offload.counters.reloaded_blocks >= offload.counters.prefetched_blocks


def test_with_prefetch_off_nothing_is_loaded_ahead(patched):
    scheduler, trace, errors = _burst(patched, prefetch_bytes=0)
    assert errors == [] and scheduler.kvelastic_prefetch is None
    assert scheduler.kvelastic_offload.counters.prefetched_blocks == 0
    assert prefill(trace, "b") < prefill(trace, "a") / 2  # the host tier still serves the prefix
