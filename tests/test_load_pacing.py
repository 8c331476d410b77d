"""Host loads paced: part of a burst waits a step while its blocks load beside the step's compute.

Through vLLM's real BlockPool (host backend), then vLLM's real Scheduler (sync and
async) with a stand-in forward pass that checks that every block a request reads
holds the data its tokens wrote, and stamps the blocks it writes.
"""

from __future__ import annotations

import hashlib
import types

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from kvelastic.integration.load_pacing import LoadPacer  # noqa: E402
from kvelastic.integration.offload_setup import attach_offload  # noqa: E402
from tests.kv_fixtures import BS, GROUP_BYTES  # noqa: E402
from tests.scheduler_harness import check_every_step, drive, drive_async, make_requests, prefill  # noqa: E402
from tests.test_offload import _read, _stamp  # noqa: E402
from tests.test_page_aware_block_pool import StandInRequest, build  # noqa: E402
from tests.test_real_scheduler import patched  # noqa: E402,F401 - the fixture

BLOCK_BYTES = 3 * 2 * BS * 2 * 32 * 2  # three layers, K and V, 16 tokens x 2 heads x 32 dims of bf16


def _on_host(count: int):
    """A pool whose ``count`` cached blocks went to the host tier when their groups were released."""
    pool, views, cache, bp, queue = build(limit_groups=None)
    manager = attach_offload(bp, queue, cache, cpu_bytes=1 << 20)
    blocks = bp.get_new_blocks(count)
    for i, block in enumerate(blocks):
        _stamp(views, block.block_id, i % 90 + 1)
    hashes = [b"h%d" % i for i in range(count)]
    bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, count, BS, 0)
    bp.free_blocks(blocks)
    queue.reclaim_cached(groups_wanted=10)
    keys = [make_block_hash_with_group_id(h, 0) for h in hashes]
    gone = [i for i, k in enumerate(keys) if manager.gpu_lookup(k) is None]
    assert len(gone) > 20  # group 0 (vLLM's null block) kept the rest
    return pool, views, bp, manager, keys, gone


def test_loads_no_request_holds_run_beside_compute_and_land_right():
    pool, views, bp, manager, keys, gone = _on_host(60)
    held = bp.get_cached_block(b"h%d" % gone[0], [0])[0]
    bp.touch([held])  # a scheduled request holds this one
    spare = bp.get_cached_block(b"h%d" % gone[1], [0])[0]  # looked up, then declined: nobody holds it
    assert manager.load_queued(held.block_id) and manager.load_queued(spare.block_id)
    manager.flush()
    assert manager.counters.background_blocks == 1 and manager.counters.reloaded_blocks == 2
    assert _read(views, held.block_id) == [gone[0] % 90 + 1] and _read(views, spare.block_id) == [gone[1] % 90 + 1]
    pool.close()


def test_load_ahead_walks_a_prefix_to_its_first_unknown_block_within_the_budget():
    pool, views, bp, manager, keys, gone = _on_host(60)
    unknown = make_block_hash_with_group_id(b"never", 0)
    walked = keys[:gone[10]] + [unknown] + keys[gone[10]:]
    assert manager.load_ahead([walked], budget=100) == 10  # stops at the block nobody holds
    assert manager.load_ahead([keys], budget=5) == 5  # the budget holds
    manager.flush()
    assert manager.counters.background_blocks == 15
    for i in gone[:15]:
        block = bp.get_cached_block(b"h%d" % i, [0])
        assert block is not None and _read(views, block[0].block_id) == [i % 90 + 1]
    assert manager.tier.hits == 15  # found on the GPU now: no second load
    pool.close()


def test_load_ahead_under_full_memory_never_evicts_the_prefix_it_is_loading():
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
    assert sum(manager.gpu_lookup(k) is not None for k in keys) == 11
    assert manager.load_ahead([keys], budget=31) == 20  # room made by evicting the n* blocks only
    manager.flush()
    for i in range(31):
        block = bp.get_cached_block(b"o%d" % i, [0])
        assert block is not None and _read(views, block[0].block_id) == [5]
    pool.close()


def _blocks(*ids: int) -> list[list]:
    return [[types.SimpleNamespace(block_id=i) for i in ids]]


def test_the_pacer_admits_the_first_loader_always_and_holds_back_past_the_budget():
    queued = set(range(100))
    walked: list = []
    manager = types.SimpleNamespace(load_queued=queued.__contains__,
                                    load_ahead=lambda prefixes, budget: walked.append((list(prefixes), budget)))
    waiting = [types.SimpleNamespace(block_hashes=[b"x", b"y"])]
    pacer = LoadPacer(manager, budget_blocks=10, waiting=lambda: waiting, key_of=lambda h: h.upper())
    assert pacer.admit(_blocks(200, 201))  # a GPU hit with no load: nothing counted
    assert pacer.admit(_blocks(*range(12)))  # the first loader, over the budget alone: admitted
    assert pacer.admit(_blocks(*range(12)))  # the same blocks (a shared prefix): nothing new
    assert not pacer.admit(_blocks(50))  # one more would pass the budget: held back
    assert pacer.held_back == 1
    pacer.end_step()
    assert walked == [([[b"X", b"Y"]], 10)]  # the requests behind it load beside the step
    assert pacer.admit(_blocks(50, 51))  # a new step: the budget is fresh
    pacer.end_step()
    assert len(walked) == 1  # nothing held back: no walk


def checking_forward(views, errors: list):
    """The stand-in forward pass: read blocks must hold their tokens' value; written blocks get theirs."""

    def value(tokens: list[int]) -> int:
        return hashlib.sha256(repr(tokens).encode()).digest()[0] % 100 + 1

    def forward(scheduler, out) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            start = request.num_computed_tokens - n  # the scheduler already counted this step's tokens
            ids = scheduler.kv_cache_manager.get_block_ids(rid)[0]
            tokens = request.all_token_ids
            for i in range(start // BS):
                if _read(views, ids[i]) != [value(tokens[i * BS:(i + 1) * BS])]:
                    errors.append((rid, i, ids[i]))
            for i in range(start // BS, (start + n - 1) // BS + 1):
                _stamp(views, ids[i], value(tokens[i * BS:min((i + 1) * BS, start + n)]))

    return forward


def _burst(patched, budget_blocks: int, asynchronous: bool = False):
    """16 prompts, other work that pushes them to the host, then the same 16 again at once."""
    scheduler, pool, views = patched(cpu_bytes=32 * GROUP_BYTES, load_budget_bytes=budget_blocks * BLOCK_BYTES,
                                     asynchronous=asynchronous)
    errors: list = []
    waves = [make_requests("a", 16, 320, 0, seed=0), make_requests("f", 8, 400, 0, seed=9),
             make_requests("b", 16, 320, 0, seed=0)]
    run = drive_async if asynchronous else drive
    kwargs = {} if asynchronous else {"forward": checking_forward(views, errors)}
    trace = run(scheduler, waves, after_step=check_every_step(pool), **kwargs)
    return scheduler, trace, errors


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_burst_over_the_budget_is_paced_and_every_block_holds_its_data(patched, asynchronous):
    scheduler, trace, errors = _burst(patched, budget_blocks=40, asynchronous=asynchronous)
    assert errors == []
    pacer, offload = scheduler.kv_cache_manager.coordinator.kvelastic_guard.pacer, scheduler.kvelastic_offload
    assert pacer.held_back > 0 and offload.counters.background_blocks > 0
    assert not scheduler.has_requests()
    assert prefill(trace, "b") < prefill(trace, "a") / 4  # the prefixes came back, none recomputed


def test_without_a_budget_nothing_is_held_back(patched):
    scheduler, trace, errors = _burst(patched, budget_blocks=0)
    assert errors == [] and scheduler.kv_cache_manager.coordinator.kvelastic_guard.pacer is None
    assert prefill(trace, "b") < prefill(trace, "a") / 4
