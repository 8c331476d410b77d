"""A connector's own walk of the GPU free queue (SimpleCPUOffload's lazy mode) over the page-aware queue.

vLLM's real BlockPool made page-aware is driven beside a vanilla BlockPool with
the same operations (allocations mirrored block for block, frees, caching,
prefix hits, reclaims). After every step the page-aware queue's walk, both the
pointer walk from ``fake_free_list_head`` (lazy mode up to 0.25) and
``iter_blocks_after`` (from 0.26), must offer exactly the free blocks of mapped
groups, and the blocks the test freed must come in the order vLLM's own queue
holds them: least recently freed first, hash-less blocks at the front (0.23+).
"""

from __future__ import annotations

import hashlib

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvelastic.hooks.block_pool import make_page_aware
from kvelastic.scheduler.free_queue import PageAwareFreeQueue
from kvelastic.scheduler.mapper import GroupMapper
from kvelastic.patches.offload_connectors import LAZY_WALK_MEMBERS
from tests.kv_fixtures import BS, GROUP_PAGES, N, PAGE, StandInRequest, build_cache
from tests.scheduler_harness import replayable_clock, scheduler_patcher

block_pool_module = pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")
BlockPool = block_pool_module.BlockPool


def pointer_walk(queue) -> list[int]:
    """What lazy mode up to 0.25 reads: ``next_free_block`` from the head until the tail (or None)."""
    ids, node = [], queue.fake_free_list_head.next_free_block
    while node is not None and node is not queue.fake_free_list_tail:
        ids.append(node.block_id)
        node = node.next_free_block
    return ids


class WalkMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool, self.views, self.cache = build_cache(5)
        self.bp = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
        self.queue: PageAwareFreeQueue = make_page_aware(self.bp, self.cache, GroupMapper(self.cache), patcher=scheduler_patcher())
        replayable_clock(self.queue)
        self.vanilla = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
        self.owned: list[int] = []    # one entry per reference held, in both pools
        self.freed: set[int] = set()  # blocks this test freed that have kept their place since
        self.counter = 0
        release_empty = self.queue.free.release_empty

        def spy(groups: list[int]) -> list[int]:
            released = release_empty(groups)
            for g in released:
                self.freed.difference_update(self.cache.blocks_of_group(g))
            return released

        self.queue.free.release_empty = spy

    def _sync_evictions(self) -> None:
        """Hashes the page-aware pool dropped (reuse, reclaim) are dropped in the vanilla one too."""
        for block, twin in zip(self.bp.blocks, self.vanilla.blocks):
            if block.block_hash is None and twin.block_hash is not None:
                self.vanilla._maybe_evict_cached_block(twin)

    @rule(n=st.integers(1, 60))
    def allocate(self, n: int) -> None:
        if n > self.bp.get_num_free_blocks():
            return
        taken = self.bp.get_new_blocks(n)
        self._sync_evictions()
        self.vanilla.touch([self.vanilla.blocks[b.block_id] for b in taken])  # the same blocks leave its queue
        self.owned.extend(b.block_id for b in taken)
        self.freed.difference_update(b.block_id for b in taken)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def cache_some(self, data) -> None:
        hashless = sorted({b for b in self.owned if self.bp.blocks[b].block_hash is None})
        if not hashless:
            return
        chosen = data.draw(st.lists(st.sampled_from(hashless), min_size=1, max_size=6, unique=True))
        hashes = []
        for _ in chosen:
            self.counter += 1
            hashes.append(hashlib.sha256(str(self.counter).encode()).digest())
        for pool in (self.bp, self.vanilla):
            pool.cache_full_blocks(StandInRequest(hashes), [pool.blocks[b] for b in chosen], 0, len(chosen), BS, 0)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_some(self, data) -> None:
        """One reference to each of some held blocks, freed in one call (as a finished request frees)."""
        held = sorted(set(self.owned))
        released = data.draw(st.permutations(held))[:data.draw(st.integers(1, len(held)))]
        for block_id in released:
            self.owned.remove(block_id)
        for pool in (self.bp, self.vanilla):
            pool.free_blocks([pool.blocks[b] for b in released])
        self.freed.update(b for b in released if self.bp.blocks[b].ref_cnt == 0  # unless released at once
                          and self.queue.free.is_mapped(self.cache.group_of_block(b)))

    @rule(data=st.data())
    def prefix_hit(self, data) -> None:
        """Touch a free cached block, as a prefix hit (or lazy mode pinning a block it copies) does."""
        cached = sorted(b.block_id for b in self.queue.iter_blocks_after(None) if b.block_hash is not None)
        if not cached:
            return
        block_id = data.draw(st.sampled_from(cached))
        for pool in (self.bp, self.vanilla):
            pool.touch([pool.blocks[block_id]])
        self.owned.append(block_id)
        self.freed.discard(block_id)

    @rule(groups=st.integers(1, 3))
    def reclaim(self, groups: int) -> None:
        self.queue.reclaim_cached(groups_wanted=groups)
        self._sync_evictions()

    @rule(limit=st.sampled_from([3, 5, 8]))
    def set_limit(self, limit: int) -> None:
        self.pool.set_limit(limit * GROUP_PAGES * PAGE)

    @invariant()
    def the_walk_offers_the_free_blocks_of_mapped_groups_in_vllms_order(self) -> None:
        walk = [b.block_id for b in self.queue.iter_blocks_after(None)]
        assert pointer_walk(self.queue) == walk
        free_mapped = {b.block_id for b in self.bp.blocks if b.ref_cnt == 0 and not b.is_null
                       and self.queue.free.is_mapped(self.cache.group_of_block(b.block_id))}
        assert len(walk) == len(set(walk)) and set(walk) == free_mapped
        theirs = [b.block_id for b in self.vanilla.free_block_queue.get_all_free_blocks()]
        assert [b for b in walk if b in self.freed] == [b for b in theirs if b in self.freed]
        if walk:  # lazy mode resumes after the block it visited last
            middle = self.bp.blocks[walk[len(walk) // 2]]
            assert [b.block_id for b in self.queue.iter_blocks_after(middle)] == walk[len(walk) // 2 + 1:]

    def teardown(self) -> None:
        self.pool.close()


WalkMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestWalkMachine = WalkMachine.TestCase


def test_a_walker_whose_place_was_released_starts_again_from_the_front() -> None:
    """Lazy mode keeps the block it visited last; if kvelastic unmaps that block's group, the walk restarts."""
    pool, _, cache = build_cache(8)
    bp = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    queue = make_page_aware(bp, cache, GroupMapper(cache), patcher=scheduler_patcher())
    blocks = bp.get_new_blocks(3 * cache.blocks_per_group)  # three groups
    bp.free_blocks(blocks)
    cursor = blocks[-1]
    queue.set_idle()  # no group kept mapped ahead: the empty ones are released
    group = cache.group_of_block(cursor.block_id)
    assert not queue.free.is_mapped(group)
    assert cursor.ref_cnt == 0  # still free, so lazy mode keeps it as its place
    expected = [b.block_id for b in queue.iter_blocks_after(None)]
    assert [b.block_id for b in queue.iter_blocks_after(cursor)] == expected
    node, seen = cursor.next_free_block, []  # the pointer walk up to 0.25 reaches the same blocks
    while node is not None and node is not queue.fake_free_list_tail:
        if node.block_id >= 0:
            seen.append(node.block_id)
        node = node.next_free_block
    assert seen == expected
    assert all(cache.group_of_block(b) != group for b in expected)
    pool.close()


def test_a_group_mapped_after_blocks_were_freed_joins_the_never_used_blocks_ahead_of_them() -> None:
    """On vanilla vLLM a block never used waits ahead of every freed one; a group the mapper maps late must
    too, or a walker covering a fixed count from the front (lazy mode) reaches cached blocks sooner."""
    pool, _, cache = build_cache(8)
    bp = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    queue = make_page_aware(bp, cache, GroupMapper(cache), patcher=scheduler_patcher())
    vanilla = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(2 * cache.blocks_per_group)]
    for each in (bp, vanilla):
        blocks = each.get_new_blocks(len(hashes))
        each.cache_full_blocks(StandInRequest(hashes), blocks, 0, len(blocks), BS, 0)
        each.free_blocks(blocks)
    new = next(g for g in range(cache.num_groups) if not queue.free.is_mapped(g))
    queue.mapper.map_now([new])
    queue.mapped_free_blocks()  # the scheduler's next count adopts what the mapper mapped
    walk = [b.block_id for b in queue.iter_blocks_after(None)]
    first_cached = next(i for i, b in enumerate(walk) if bp.blocks[b].block_hash is not None)
    assert set(cache.blocks_of_group(new)) <= set(walk[:first_cached])
    theirs = [b.block_id for b in vanilla.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
    assert [b for b in walk if bp.blocks[b].block_hash is not None] == theirs
    pool.close()


def test_the_page_aware_queue_offers_every_declared_lazy_walk_member() -> None:
    for _, members in LAZY_WALK_MEMBERS:
        assert sorted(name for name in members if not hasattr(PageAwareFreeQueue, name)) == []
