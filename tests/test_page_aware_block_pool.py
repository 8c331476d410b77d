"""vLLM's real BlockPool, made page-aware over the host backend, under random use.

The stand-in request below only carries ``block_hashes``, the one attribute
``BlockPool.cache_full_blocks`` reads; everything else is vLLM's own code.
"""

from __future__ import annotations

import hashlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvelastic.hooks.block_pool import make_page_aware
from kvelastic.scheduler.mapper import GroupMapper

from tests.kv_fixtures import BS, GROUP_PAGES, N, PAGE, StandInRequest, build_cache  # noqa: E402,F401
from tests.scheduler_harness import replayable_clock, scheduler_patcher

block_pool_module = pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")
BlockPool = block_pool_module.BlockPool



def build(limit_groups: int | None):
    pool, views, cache = build_cache(limit_groups)
    block_pool = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    queue = make_page_aware(block_pool, cache, GroupMapper(cache), patcher=scheduler_patcher())
    return pool, views, cache, block_pool, queue


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool, self.views, self.cache, self.bp, self.queue = build(limit_groups=5)
        replayable_clock(self.queue)
        self.owned: list = []          # one entry per reference we hold
        self.stamp: dict[int, int] = {}  # block id -> value written into its K and V
        self.hash_of: dict[int, bytes] = {}
        self.counter = 0

    def _write(self, block) -> None:
        self.counter += 1
        value = self.counter % 97 + 1
        self.stamp[block.block_id] = value
        for view in self.views:
            view[:, block.block_id].fill_(value)

    def _check(self, block_id: int) -> None:
        for view in self.views:
            assert torch.all(view[:, block_id] == self.stamp[block_id]), f"block {block_id} lost its data"

    @rule(n=st.integers(1, 70))
    def allocate(self, n: int) -> None:
        if n > self.bp.get_num_free_blocks():
            with pytest.raises(ValueError):
                self.bp.get_new_blocks(n)
            return
        for block in self.bp.get_new_blocks(n):
            assert block.ref_cnt == 1 and block.block_hash is None
            self.hash_of.pop(block.block_id, None)
            self._write(block)
            self.owned.append(block)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def cache_some(self, data) -> None:
        candidates = sorted({b.block_id: b for b in self.owned if b.block_hash is None}.items())
        if not candidates:
            return
        picks = data.draw(st.lists(st.integers(0, len(candidates) - 1), min_size=1, max_size=8, unique=True))
        chosen = [candidates[i][1] for i in picks]
        hashes = []
        for block in chosen:
            self.counter += 1
            hashes.append(hashlib.sha256(str(self.counter).encode()).digest())
        self.bp.cache_full_blocks(StandInRequest(hashes), chosen, 0, len(chosen), BS, 0)
        for block, digest in zip(chosen, hashes):
            self.hash_of[block.block_id] = digest

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_some(self, data) -> None:
        count = data.draw(st.integers(1, len(self.owned)))
        released, self.owned = self.owned[:count], self.owned[count:]
        for block in released:  # one reference per call: vLLM never frees one block twice in a call
            self.bp.free_blocks([block])

    @precondition(lambda self: self.hash_of)
    @rule(data=st.data())
    def prefix_hit(self, data) -> None:
        block_id = data.draw(st.sampled_from(sorted(self.hash_of)))
        found = self.bp.get_cached_block(self.hash_of[block_id], [0])
        if found is None:
            return
        block = found[0]
        self._check(block.block_id)  # a cached block must still hold what was written
        self.bp.touch([block])
        self.owned.append(block)

    @rule(groups=st.integers(1, 3))
    def reclaim(self, groups: int) -> None:
        self.queue.reclaim_cached(groups_wanted=groups)

    @rule(limit=st.sampled_from([3, 5, 8, None]))
    def set_limit(self, limit) -> None:
        self.pool.set_limit(None if limit is None else limit * GROUP_PAGES * PAGE)

    @invariant()
    def live_and_cached_blocks_are_mapped_and_intact(self) -> None:
        live = {b.block_id for b in self.owned}
        for block_id in live:
            assert self.pool.is_mapped(self.cache.group_of_block(block_id))
            self._check(block_id)
        for block_id, digest in self.hash_of.items():
            found = self.bp.get_cached_block(digest, [0])
            if found is not None and found[0].block_id == block_id:
                assert self.pool.is_mapped(self.cache.group_of_block(block_id))
                self._check(block_id)

    @invariant()
    def counts_agree_with_vllm(self) -> None:
        refs = sum(1 for b in self.bp.blocks if b.ref_cnt > 0 and not b.is_null)
        assert refs == len({b.block_id for b in self.owned})
        assert self.queue.num_in_use == refs + 1
        assert self.bp.get_num_free_blocks() >= 0
        all_free = self.queue.get_all_free_blocks()
        assert len(all_free) == N - 1 - refs
        assert all(b.ref_cnt == 0 for b in all_free)

    @invariant()
    def mapped_groups_hold_something(self) -> None:
        busy = {self.cache.group_of_block(b.block_id) for b in self.bp.blocks
                if (b.ref_cnt > 0 or b.block_hash is not None) and not b.is_null}
        idle_mapped = self.pool.mapped_groups() - busy - {0}
        assert len(idle_mapped) <= self.queue.prefetch.groups + len(self.queue.mapper.mapped)

    def teardown(self) -> None:
        self.pool.close()
        assert self.pool.leak_report() == []


BlockPoolMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase


def test_running_out_of_physical_memory_is_a_scheduling_miss():
    pool, views, cache, bp, queue = build(limit_groups=2)
    got = bp.get_new_blocks(bp.get_num_free_blocks())
    assert len(got) == 2 * 32 - 1  # two groups of 32 blocks, minus the null block
    assert bp.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        bp.get_new_blocks(1)
    bp.free_blocks(got)
    assert bp.get_num_free_blocks() == 63
    pool.close()


def test_reset_prefix_cache_and_usage_follow_physical_memory():
    pool, views, cache, bp, queue = build(limit_groups=4)
    blocks = bp.get_new_blocks(40)
    bp.cache_full_blocks(StandInRequest([bytes([i]) * 32 for i in range(40)]), blocks, 0, 40, BS, 0)
    assert 0.3 < bp.get_usage() < 0.35  # 40 of the 127 blocks four groups can hold
    bp.free_blocks(blocks)
    assert queue.prefetch.groups == 1  # one empty group is kept mapped ahead of need
    assert pool.num_mapped_groups() == 2 + 1  # the cached blocks keep groups 0 and 1
    assert bp.reset_prefix_cache()
    assert pool.num_mapped_groups() == 1 + 1  # group 0 (null block) and the one ahead
    assert bp.get_cached_block(bytes([3]) * 32, [0]) is None
    pool.close()


def test_idle_cached_groups_are_reclaimed_oldest_first():
    clock = [100.0]
    pool, views, cache, bp, queue = build(limit_groups=None)
    queue._clock = queue.room.clock = lambda: clock[0]
    early = bp.get_new_blocks(63)  # blocks 1..63: the rest of group 0 and all of group 1
    bp.cache_full_blocks(StandInRequest([b"a%d" % i for i in range(63)]), early, 0, 63, BS, 0)
    bp.free_blocks(early)
    clock[0] = 200.0
    late = bp.get_new_blocks(40)
    bp.cache_full_blocks(StandInRequest([b"b%d" % i for i in range(40)]), late, 0, 40, BS, 0)
    bp.free_blocks(late)
    assert pool.mapped_groups() == {0, 1, 2, 3, 4}  # cached blocks keep 0-3; 4 is mapped ahead
    assert queue.reclaim_cached(idle_before=150.0) == 1
    assert pool.mapped_groups() == {0, 2, 3, 4}  # group 0 holds the null block and is never released
    assert bp.get_cached_block(b"a62", [0]) is None  # block 63 lived in group 1
    assert bp.get_cached_block(b"a0", [0]) is not None  # block 1 lives in group 0
    assert bp.get_cached_block(b"b39", [0]) is not None
    assert queue.reclaim_cached(idle_before=250.0) == 2
    queue.set_idle()
    assert pool.mapped_groups() == {0}
    pool.close()


def test_a_stale_estimate_is_honoured_by_going_over_the_limit(kv_log):
    pool, views, cache, bp, queue = build(limit_groups=4)
    promised = bp.get_num_free_blocks()  # the scheduler's view: 4 groups' worth
    pool.set_limit(1 * GROUP_PAGES * PAGE)  # the limit drops before the blocks are taken
    queue.room.valid_until = float("inf")  # and the estimate has not caught up yet
    got = bp.get_new_blocks(promised)  # no crash: vLLM already decided on this number
    assert len(got) == promised
    assert pool.stats().over_limit_bytes > 0
    assert "past the limit" in kv_log.text
    bp.free_blocks(got)
    queue.set_idle()
    pool.collect()
    assert pool.stats().over_limit_bytes == 0
    pool.close()


def test_the_room_left_is_read_from_the_pool_at_most_once_a_millisecond_and_again_after_a_map():
    """At the limit every free and every rebalance asks how many more groups fit, dozens of times a step:
    the pool's source stack answers at most once a millisecond, and again as soon as a group is mapped."""
    clock = [100.0]
    pool, views, cache, bp, queue = build(limit_groups=4)
    queue._clock = queue.room.clock = lambda: clock[0]
    taken = bp.get_new_blocks(bp.get_num_free_blocks())  # all the limit allows: no empty group is left
    assert not queue.free.empty and queue.prefetch.groups >= 1  # so each rebalance wants one more
    reads = []
    ask_pool = cache.mappable_groups
    cache.mappable_groups = lambda unmapped: reads.append(unmapped) or ask_pool(unmapped)
    queue.room.forget()
    for _ in range(50):
        assert bp.get_num_free_blocks() == 0
        queue._balance()
    assert len(reads) == 1
    pool.set_limit(6 * GROUP_PAGES * PAGE)  # two groups more: seen once the millisecond is over
    assert bp.get_num_free_blocks() == 0 and len(reads) == 1
    clock[0] += 0.001
    assert bp.get_num_free_blocks() == 2 * 32 and len(reads) == 2
    more = bp.get_new_blocks(33)  # maps both groups: the room is read again at once
    assert bp.get_num_free_blocks() == 31 and len(reads) > 2
    bp.free_blocks(taken + more)
    pool.close()
