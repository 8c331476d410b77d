"""Write-through to the host tier, through vLLM's real BlockPool (host backend).

``manager.end_step()`` stands for the end of one ``schedule()``; vLLM's own
``cache_full_blocks`` names the blocks (through the wrapped instance method).
A recording copier around the real one shows which copies were issued, with
fences the test lets pass or not, as a CUDA stream would.
"""

from __future__ import annotations

import pytest

from kvelastic.hooks.offload_setup import local_host_tier, wire_offload
from kvelastic.offload.write_through import DELAY_STEPS, STEP_BYTES
from kvelastic.pool.backend import Fence
from tests.host_plans import IN_PROCESS, ON_RANKS
from tests.scheduler_harness import scheduler_patcher
from tests.test_page_aware_block_pool import BS, StandInRequest, build

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

CPU_BYTES = 1 << 20


class Gate(Fence):
    """A fence the test opens: a store still running on the copy stream until then."""

    def __init__(self, done: bool):
        self.done = done

    def is_done(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.done = True


class Recording:
    """The real copier (CPU: synchronous), recording each call; stores beside compute return a Gate. It has
    one stream, so write-through's stores share it (beside it: ``test_side_stores.SideRecording``)."""

    side_stores = False

    def __init__(self, copier, stores_done: bool = True):
        self.inner = copier
        self.bytes_per_block = copier.bytes_per_block
        self.calls: list[tuple] = []
        self.stores_done = stores_done
        self.gates: list[Gate] = []

    def store(self, block_ids, slots, *, block_compute=False):
        self.calls.append(("store", tuple(block_ids), block_compute))
        self.inner.store(block_ids, slots, block_compute=block_compute)
        if block_compute:
            return self.inner.store([], [])
        self.gates.append(Gate(self.stores_done))
        return self.gates[-1]

    def load(self, block_ids, slots, *, block_compute=True):
        self.calls.append(("load", tuple(block_ids)))
        return self.inner.load(block_ids, slots, block_compute=block_compute)

    def fence_compute(self):
        self.calls.append(("fence",))

    def copy_times(self):
        return self.inner.copy_times()

    def kinds(self) -> list:
        return [(c[0], c[2]) if c[0] == "store" else (c[0],) for c in self.calls]


def _stamp(views, block_id: int, value: int) -> None:
    for view in views:
        view[:, block_id].fill_(value)


def _read(views, block_id: int) -> list[int]:
    return sorted({int(v) for view in views for v in view[:, block_id].unique()})


def _setup(limit_groups=1, stores_done=True, recording_class=None, plan=IN_PROCESS):
    """The host tier wired as ``plan`` has it; ``recording_class``: the recording copier (default
    :class:`Recording`)."""
    pool, views, cache, bp, queue = build(limit_groups=limit_groups)
    tier, copier = local_host_tier(cache, CPU_BYTES, "arc", plan)
    recording = (recording_class or Recording)(copier, stores_done)
    manager = wire_offload(bp, queue, tier, recording, scheduler_patcher(), plan)
    return pool, views, bp, manager, recording


def _computed(bp, views, count: int, tag: str, value=lambda i: i % 90 + 1):
    """``count`` new blocks written and named full, as one step's schedule and forward pass would."""
    blocks = bp.get_new_blocks(count)
    for i, block in enumerate(blocks):
        _stamp(views, block.block_id, value(i))
    hashes = [f"{tag}{i}".encode() for i in range(count)]
    bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, count, BS, 0)
    return blocks, hashes


def _computed_and_issued(bp, views, manager, count: int, tag: str, **kw):
    """:func:`_computed`, then the steps after which write-through has issued their stores."""
    blocks, hashes = _computed(bp, views, count, tag, **kw)
    for _ in range(DELAY_STEPS + 1):
        manager.end_step()
    return blocks, hashes


def test_a_computed_block_is_stored_two_steps_later_and_its_eviction_copies_nothing():
    pool, views, bp, manager, copier = _setup()
    blocks, hashes = _computed(bp, views, 31, "a")
    assert DELAY_STEPS == 2
    for _ in range(2):  # the step that names them, and the next (its forward pass may not have run yet)
        manager.end_step()
        assert copier.calls == [], "stored before the forward pass that computes it is known to have run"
    manager.end_step()
    assert copier.kinds() == [("store", False)] and len(copier.calls[0][1]) == 31  # beside compute
    assert manager.counters.stored_ahead_blocks == 31 and manager.tier.stats().slots_used == 31
    assert manager.tier.hits == manager.tier.misses == 0 and len(manager.tier.policy) == 0  # not a request
    bp.free_blocks(blocks)
    newer = bp.get_new_blocks(31)  # memory is full: every cached block is evicted for reuse
    manager.end_step()
    assert copier.kinds() == [("store", False)], "an eviction found its copy made ahead: no copy, no fence"
    assert manager.counters.evicted_free == 31 and manager.counters.spilled_blocks == 0
    assert len(manager.tier.policy) == 31  # admitted at eviction, as without write-through
    for block in newer:
        _stamp(views, block.block_id, 99)
    bp.free_blocks(newer[:5])
    found = bp.get_cached_block(hashes[3], [0])  # a GPU miss served by the host
    manager.end_step()
    assert found is not None and _read(views, found[0].block_id) == [3 % 90 + 1]
    assert manager.tier.hits == 1 and manager.stats()["spilled_bytes"] == 31 * copier.bytes_per_block
    pool.close()


def test_the_fence_is_taken_only_for_a_block_reused_before_its_store_passed():
    pool, views, bp, manager, copier = _setup(stores_done=False)
    blocks, _ = _computed_and_issued(bp, views, manager, 20, "a")
    assert copier.kinds() == [("store", False)]
    bp.free_blocks(blocks[:10])
    others, _ = _computed(bp, views, 11, "x")  # the 11 free uncached blocks: no eviction, no fence
    manager.end_step()
    assert ("fence",) not in copier.kinds()
    bp.free_blocks(others)
    bp.get_new_blocks(10)  # evicts cached blocks: among them the 10 a store still reads
    manager.end_step()
    assert copier.kinds().count(("fence",)) == 1 and manager.counters.store_fences == 1
    assert not any(c[0] == "store" and c[2] for c in copier.calls), "a fence, not a second copy"
    copier.gates[0].done = True  # the first store has passed: reusing its other blocks needs nothing
    bp.free_blocks(blocks[10:])
    bp.get_new_blocks(bp.get_num_free_blocks())
    manager.end_step()
    assert copier.kinds().count(("fence",)) == 1
    pool.close()


def reuse_a_stored_block_and_load(bp, views, manager) -> None:
    """Blocks stored ahead, their stores still running; in one step most are reused and one key loads back."""
    old, hashes = _computed_and_issued(bp, views, manager, 31, "o", value=lambda i: 5)
    bp.free_blocks(old)
    newer = bp.get_new_blocks(31)  # reuses blocks a store still reads
    bp.free_blocks(newer[:1])
    assert bp.get_cached_block(hashes[0], [0]) is not None  # and loads one back
    manager.end_step()


def test_a_step_that_loads_needs_no_separate_fence():
    pool, views, bp, manager, copier = _setup(stores_done=False)
    reuse_a_stored_block_and_load(bp, views, manager)
    assert ("load",) in copier.kinds() and ("fence",) not in copier.kinds()  # the load's wait covers it
    pool.close()


def test_a_block_reused_before_its_store_was_issued_is_copied_at_eviction():
    pool, views, bp, manager, copier = _setup()
    blocks, hashes = _computed(bp, views, 31, "a", value=lambda i: 7)
    manager.end_step()
    bp.free_blocks(blocks)
    newer = bp.get_new_blocks(31)
    manager.end_step()
    assert copier.kinds() == [("store", True)]  # as without write-through: compute waits for it
    assert manager.counters.spilled_blocks == 31 and manager.counters.evicted_free == 0
    for _ in range(DELAY_STEPS + 1):
        manager.end_step()
    assert copier.kinds() == [("store", True)], "the blocks were evicted: nothing is due for them any more"
    for block in newer:
        _stamp(views, block.block_id, 9)
    bp.free_blocks(newer[:3])
    found = bp.get_cached_block(hashes[0], [0])
    manager.end_step()
    assert _read(views, found[0].block_id) == [7]
    pool.close()


def test_a_block_rehashed_or_dropped_before_its_store_is_not_stored():
    pool, views, bp, manager, copier = _setup(limit_groups=2)
    blocks, _ = _computed(bp, views, 8, "a")
    bp.evict_blocks({b.block_id for b in blocks[:4]})  # vLLM drops their hashes (a connector's failed load)
    for _ in range(DELAY_STEPS + 1):
        manager.end_step()
    assert copier.calls and set(copier.calls[0][1]) == {b.block_id for b in blocks[4:]}
    pool.close()


def test_the_step_cap_spreads_stores_over_steps():
    pool, views, bp, manager, copier = _setup()
    assert manager.write_through.max_blocks_per_step == STEP_BYTES // copier.bytes_per_block
    manager.write_through.max_blocks_per_step = 1  # the cap at one block a step
    _computed(bp, views, 3, "a")
    for _ in range(DELAY_STEPS + 3):
        manager.end_step()
    assert [len(c[1]) for c in copier.calls] == [1, 1, 1]
    pool.close()


def test_group_release_waits_for_a_store_still_reading_it():
    pool, views, bp, manager, copier = _setup(limit_groups=None, stores_done=False)
    blocks, _ = _computed_and_issued(bp, views, manager, 40, "a")
    bp.free_blocks(blocks)
    leaving = [b for b in blocks if b.block_id >= 32]  # group 1's blocks; group 0 holds the null block
    fence = manager.spill(leaving, before_reuse=False)
    assert fence is not None and not fence.is_done(), "the unmap must wait for the store"
    assert manager.counters.evicted_free == len(leaving) and manager.counters.spilled_blocks == 0
    copier.gates[0].done = True
    assert fence.is_done()
    pool.close()


def test_the_plan_on_worker_ranks_stores_nothing_ahead():
    pool, views, bp, manager, copier = _setup(plan=ON_RANKS)
    _computed(bp, views, 10, "a")
    for _ in range(DELAY_STEPS + 2):
        manager.end_step()
    assert copier.calls == [] and manager.write_through is None
    assert manager.tier.policy.capacity == manager.tier.slots  # no share kept for copies made ahead
    pool.close()
