"""Asynchronous host-tier loads: the ledger alone, then vLLM's real Scheduler with kvelastic's connector.

The scheduler is vLLM's own (``tests/scheduler_harness.py``); the host tier is
kvelastic's index (ARC); the copier is a stand-in whose fences the test passes
by hand and which moves a tag per block, so every loaded block's data is
checked. The connector is wired as ``attach_scheduler`` will wire it: set on
``Scheduler.connector``, loads issued after ``schedule()``, completions fed to
``update_from_output`` (docs/offload.md, "How a host hit comes back").
"""

from __future__ import annotations

from typing import Sequence

import pytest

from kvelastic.offload.async_loads import AsyncLoads
from kvelastic.offload.host_tier import HostTier
from kvelastic.pool.backend import Fence

BLOCK_BYTES = 1024


class HandFence(Fence):
    def __init__(self, copy):
        self.copy, self.passed = copy, False

    def is_done(self) -> bool:
        return self.passed

    def wait(self) -> None:
        self.pass_()

    def pass_(self) -> None:
        if not self.passed:
            self.copy()
            self.passed = True


class HandCopier:
    """Host slots hold tags; a load writes them into ``gpu`` only when its fence is passed."""

    bytes_per_block = BLOCK_BYTES

    def __init__(self):
        self.host: dict[int, object] = {}
        self.gpu: dict[int, object] = {}
        self.loads: list[tuple[list[int], list[int], bool, HandFence]] = []
        self.fail = False

    def load(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = True) -> HandFence:
        if self.fail:
            raise RuntimeError("copy refused")
        ids, slots = list(block_ids), list(slots)

        def copy() -> None:
            for b, s in zip(ids, slots):
                self.gpu[b] = self.host[s]

        fence = HandFence(copy)
        self.loads.append((ids, slots, block_compute, fence))
        return fence

    def pass_all(self) -> None:
        for *_, fence in self.loads:
            fence.pass_()


def tier_with(keys, copier: HandCopier, capacity: int = 64) -> HostTier:
    tier = HostTier(capacity * BLOCK_BYTES, BLOCK_BYTES, pin=False, allocate=False)
    for key in keys:
        copier.host[tier.admit(key)] = ("data", key)
    return tier


# ------------------------------------------------------------------ the ledger alone
class Block:
    def __init__(self, block_id: int):
        self.block_id, self.refs = block_id, 1


def ledger(keys, capacity: int = 64, **kw):
    copier = HandCopier()
    tier = tier_with(keys, copier, capacity)

    def hold(blocks):
        for b in blocks:
            b.refs += 1

    def release(blocks):
        for b in blocks:
            b.refs -= 1

    return AsyncLoads(tier, copier, hold, release, **kw), tier, copier


def test_looking_at_a_run_changes_nothing_and_stops_at_the_first_key_the_host_lacks():
    loads, tier, _ = ledger(["a", "b", "c"])
    assert loads.host_run(["a", "b", "x", "c"]) == 2
    assert loads.host_run(["x", "a"]) == 0
    assert tier.hits == 0 and not loads.in_flight


def test_a_planned_load_pins_its_keys_and_holds_its_blocks_until_its_fence_passed():
    loads, tier, copier = ledger(["a", "b"])
    blocks = [Block(5), Block(6)]
    loads.plan("r", ["a", "b"], blocks)
    assert tier.hits == 2 and all(tier.policy.is_pinned(k) for k in "ab") and [b.refs for b in blocks] == [2, 2]
    assert loads.host_run(["a"]) is None  # another request asks again later
    loads.issue()
    assert copier.loads[0][:3] == ([5, 6], [0, 1], False)
    assert loads.retire().finished == [] and loads.waiting_for("r")
    copier.pass_all()
    retired = loads.retire()
    assert retired.finished == ["r"] and not retired.invalid_block_ids
    assert not any(tier.policy.is_pinned(k) for k in "ab") and [b.refs for b in blocks] == [1, 1]
    assert copier.gpu == {5: ("data", "a"), 6: ("data", "b")} and not loads.in_flight


def test_a_planned_run_counts_toward_the_longest_run_the_warm_reserve_covers():
    """The warm reserve for reloads sizes itself from ``HostRuns.longest``: planned asynchronous loads
    feed it as the synchronous lookups do, each request's run whole; a failed plan counts nothing."""
    from kvelastic.offload.host_runs import HostRuns

    runs = HostRuns()
    loads, tier, copier = ledger(["a", "b", "c"], runs=runs)
    loads.plan("r1", ["a", "b", "c"], [Block(1), Block(2), Block(3)])
    loads.plan("r2", ["a"], [Block(4)])
    assert runs.longest() == 3 and runs.current == 0
    tier.clear()
    loads.plan("r3", ["a", "b", "c", "a"], [Block(5), Block(6), Block(7), Block(8)])  # gone: fails
    assert runs.longest() == 3


def test_loads_retire_in_issue_order_and_a_refused_copy_is_reported_as_failed_blocks():
    loads, tier, copier = ledger(["a", "b"])
    loads.plan("r1", ["a"], [Block(1)])
    loads.issue()
    copier.fail = True
    loads.plan("r2", ["b"], [Block(2)])
    loads.issue()
    assert loads.retire().finished == []  # r2 failed, but r1 (issued first) still runs
    copier.pass_all()
    retired = loads.retire()
    assert retired.finished == ["r1", "r2"] and retired.invalid_block_ids == {2}
    assert loads.counters.failed_loads == 1 and not tier.policy.is_pinned("b")
    assert loads.host_run(["b"], "r2") == 0 and loads.host_run(["b"], "r3") == 1  # r2 is recomputed
    loads.forget("r2")
    assert loads.host_run(["b"], "r2") == 1


def test_a_run_offered_to_a_request_survives_spills_until_planned_and_is_let_go_at_the_step_end():
    """vLLM allocates a request's blocks between the lookup and the plan; that allocation may spill GPU
    blocks into a full tier. The offered run stays; an offer nobody took is released when schedule() ends."""
    loads, tier, copier = ledger(["a", "b", "c", "d"], capacity=4)
    assert loads.host_run(["a", "b"], "r") == 2
    loads.promise("r", ["a", "b"])
    loads.promise("q", ["c"])
    for spilled in ["s1", "s2", "s3"]:  # the allocation's spills
        copier.host[tier.admit(spilled)] = ("data", spilled)
    assert "a" in tier and "b" in tier and "c" in tier and "d" not in tier
    loads.promise("p", ["s3"])
    assert tier.admit("s4") is None and tier.refused_all_pinned == 1  # all resident keys pinned: not kept
    assert "s4" not in tier and "s3" in tier
    loads.plan("r", ["a", "b"], [Block(1), Block(2)])
    loads.issue()  # the end of schedule(): q's offer lapses, r's pins are its load's now
    assert tier.policy.is_pinned("a") and not tier.policy.is_pinned("c") and not tier.policy.is_pinned("s3")
    copier.pass_all()
    assert loads.retire().finished == ["r"] and copier.gpu == {1: ("data", "a"), 2: ("data", "b")}
    assert not any(tier.policy.is_pinned(k) for k in "abc")


def test_a_key_gone_before_its_plan_fails_the_load_into_a_recompute_instead_of_stopping():
    loads, tier, copier = ledger(["a", "b"], capacity=2)
    blocks = [Block(1), Block(2)]
    tier.admit("c")  # a spill with no offer holding the run: "a" leaves the tier
    assert "a" not in tier
    loads.plan("r", ["a", "b"], blocks)
    assert [b.refs for b in blocks] == [2, 2] and tier.hits == 0
    loads.issue()
    assert copier.loads == []  # nothing copied
    retired = loads.retire()
    assert retired.finished == ["r"] and retired.invalid_block_ids == {1, 2}
    assert [b.refs for b in blocks] == [1, 1] and loads.counters.failed_loads == 1
    assert loads.host_run(["b"], "r") == 0 and not tier.policy.is_pinned("b")


def test_the_loads_of_one_step_go_to_the_copier_as_one_batch_and_retire_together():
    """Several requests' runs planned in one schedule(): one copy beside compute, each load keeping its own
    blocks and slots in the batch; each request is reported once the shared fence passed."""
    loads, tier, copier = ledger(["a", "b", "c", "d", "e"])
    loads.plan("r1", ["a", "b"], [Block(10), Block(11)])
    loads.plan("tiny", ["c"], [Block(12)])
    loads.plan("r2", ["d", "e"], [Block(20), Block(21)])
    loads.issue()
    assert [(ids, slots, compute) for ids, slots, compute, _ in copier.loads] == [
        ([10, 11, 12, 20, 21], [0, 1, 2, 3, 4], False)]
    assert loads.counters.async_loads == 3 and loads.counters.async_blocks == 5
    assert loads.retire().finished == [] and all(loads.waiting_for(r) for r in ("r1", "tiny", "r2"))
    copier.pass_all()
    assert loads.retire().finished == ["r1", "tiny", "r2"] and not loads.in_flight
    assert copier.gpu == {10: ("data", "a"), 11: ("data", "b"), 12: ("data", "c"), 20: ("data", "d"),
                          21: ("data", "e")}
    assert not any(tier.policy.is_pinned(k) for k in "abcde")


def test_a_batch_the_copier_refuses_fails_every_load_in_it_and_each_is_recomputed():
    loads, tier, copier = ledger(["a", "b", "c"])
    copier.fail = True
    loads.plan("r1", ["a"], [Block(1)])
    loads.plan("r2", ["b", "c"], [Block(2), Block(3)])
    loads.issue()
    retired = loads.retire()
    assert retired.finished == ["r1", "r2"] and retired.invalid_block_ids == {1, 2, 3}
    assert loads.counters.failed_loads == 2 and not any(tier.policy.is_pinned(k) for k in "abc")
    assert loads.host_run(["a"], "r1") == 0 and loads.host_run(["b"], "r2") == 0


# ------------------------------------------------------------ vLLM's real Scheduler
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")


def keys_of(request):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return [make_block_hash_with_group_id(h, 0) for h in request.block_hashes]


def engine(host_keys, **kw):
    """vLLM's Scheduler with kvelastic's connector on it, over a host tier holding ``host_keys``."""
    from kvelastic.hooks.host_loads import make_host_loads
    from tests.scheduler_harness import make_scheduler

    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    copier = HandCopier()
    tier = tier_with(host_keys, copier)
    loads = AsyncLoads(tier, copier, pool.touch, pool.free_blocks, **kw)
    assert scheduler.connector is None
    scheduler.connector = make_host_loads(loads, scheduler)
    return scheduler, scheduler.connector, copier, tier


def step(scheduler, connector) -> dict[str, int]:
    """One engine step: schedule, issue the step's loads, the model's output with the loads retired."""
    from tests.scheduler_harness import model_output

    out = scheduler.schedule()
    connector.issue()
    samplers = {r for r in out.num_scheduled_tokens
                if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
    scheduler.update_from_output(out, connector.feed(scheduler, model_output(scheduler, out, samplers)))
    return dict(out.num_scheduled_tokens)


def requests():
    from tests.scheduler_harness import make_requests

    (b,) = make_requests("b", 1, 320, 320, seed=0)  # 20 blocks, all on the host
    (c,) = make_requests("c", 1, 64, 0, seed=1)      # nothing anywhere
    return b, c


def test_a_host_hit_waits_for_its_load_while_another_request_runs():
    from vllm.v1.request import RequestStatus

    b, c = requests()
    scheduler, connector, copier, tier = engine(keys_of(b))
    scheduler.add_request(b)
    scheduler.add_request(c)
    first = step(scheduler, connector)
    assert "b" + "-0" not in first and first["c-0"] == 64  # c computes; b does not hold it up
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ((ids, slots, block_compute, _),) = copier.loads
    assert len(ids) == 19 and not block_compute  # the last token is always computed: 19 of 20 blocks
    pool = scheduler.kv_cache_manager.block_pool
    assert all(pool.get_cached_block(h, [0]) is None for h in b.block_hashes[:19])  # not servable yet
    assert "b-0" not in step(scheduler, connector)  # still loading
    copier.pass_all()
    assert "b-0" not in step(scheduler, connector)  # its completion reaches vLLM with this step's output
    resumed = step(scheduler, connector)
    assert resumed["b-0"] == 320 - 19 * 16  # only the suffix is computed
    assert [copier.gpu[i] for i in ids] == [("data", k) for k in keys_of(b)[:19]]
    assert [pool.get_cached_block(h, [0])[0].block_id for h in b.block_hashes[:19]] == ids
    assert tier.hits == 19 and not any(tier.policy.is_pinned(k) for k in keys_of(b))
    assert all(pool.blocks[i].ref_cnt == 1 for i in ids)
    while scheduler.has_requests():
        step(scheduler, connector)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_a_second_request_for_keys_being_loaded_waits_and_then_hits_the_gpu():
    from tests.scheduler_harness import make_requests

    b, _ = requests()
    (twin,) = make_requests("t", 1, 336, 320, seed=0)
    scheduler, connector, copier, tier = engine(keys_of(b))
    scheduler.add_request(b)
    step(scheduler, connector)
    scheduler.add_request(twin)
    assert "t-0" not in step(scheduler, connector)  # asked again later, not loaded twice
    copier.pass_all()
    while scheduler.has_requests():
        step(scheduler, connector)
    assert len(copier.loads) == 1 and tier.hits == 19
    assert connector.loads.counters.deferred_lookups >= 1


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_copy_is_done():
    from vllm.v1.request import RequestStatus

    b, _ = requests()
    scheduler, connector, copier, _ = engine(keys_of(b))
    pool = scheduler.kv_cache_manager.block_pool
    scheduler.add_request(b)
    step(scheduler, connector)
    ((ids, *_),) = copier.loads
    scheduler.finish_requests("b-0", RequestStatus.FINISHED_ABORTED)
    step(scheduler, connector)
    assert all(pool.blocks[i].ref_cnt >= 1 for i in ids)  # the copy may still write them
    copier.pass_all()
    step(scheduler, connector)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not connector.loads.in_flight
    assert "b-0" not in scheduler.requests


def test_a_load_that_cannot_be_issued_is_recomputed():
    b, _ = requests()
    scheduler, connector, copier, tier = engine(keys_of(b))
    copier.fail = True
    scheduler.add_request(b)
    step(scheduler, connector)  # planned, then refused at issue
    steps = []
    while scheduler.has_requests():
        assert len(steps) < 100, "the failed load was retried instead of recomputed"
        steps.append(step(scheduler, connector).get("b-0", 0))
    assert sum(n for n in steps if n > 1) == 320  # the whole prompt computed again
    assert len(copier.loads) == 0 and connector.loads.counters.failed_loads == 1
    assert not any(tier.policy.is_pinned(k) for k in keys_of(b))
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_loads_a_reset_waited_for_still_promote_their_requests():
    """A prefix-cache reset waits for every load before the tier is cleared (``settle``); the requests those
    loads served are reported with the next output, so they are scheduled, not left waiting forever."""
    b, _ = requests()
    scheduler, connector, copier, _ = engine(keys_of(b))
    scheduler.add_request(b)
    step(scheduler, connector)  # planned and issued; its fence not passed
    connector.settle()  # as OffloadManager.reset does first: waits (here: passes the fence) and retires
    assert not connector.loads.in_flight
    steps = 0
    while scheduler.has_requests():
        assert steps < 50, "the request whose load a reset waited for was never scheduled"
        step(scheduler, connector)
        steps += 1
    assert b.num_computed_tokens >= 320


def test_spills_made_by_the_allocation_of_a_host_hit_do_not_push_its_run_out_of_the_tier():
    """As on the GPU: vLLM's allocation for a request whose prefix is on the host evicts cached GPU
    blocks, whose spills fill the host tier. Its run was offered at the lookup and must still be there
    when the load is planned (the H100 multi-turn run stopped on this before the run was held)."""
    b, _ = requests()
    scheduler, connector, copier, tier = engine(keys_of(b))
    tier.policy = type(tier.policy)(19, on_evict=tier._evicted)  # room for exactly b's run
    for key in keys_of(b)[:19]:
        tier.policy.request(key)
    manager = scheduler.kv_cache_manager
    allocate = manager.allocate_slots
    spilled = []

    def allocate_and_spill(*args, **kwargs):
        for i in range(19):  # what evicting 19 cached GPU blocks would put in the tier
            slot = tier.admit(("spilled", len(spilled)))
            spilled.append(slot)
            if slot is not None:
                copier.host[slot] = ("data", "spilled")
        return allocate(*args, **kwargs)

    manager.allocate_slots = allocate_and_spill
    scheduler.add_request(b)
    step(scheduler, connector)
    ((ids, *_),) = copier.loads
    assert len(ids) == 19 and spilled and all(slot is None for slot in spilled)  # none kept: all pinned
    copier.pass_all()
    while scheduler.has_requests():
        step(scheduler, connector)
    assert [copier.gpu[i] for i in ids] == [("data", k) for k in keys_of(b)[:19]]
    assert connector.loads.counters.failed_loads == 0
    assert not any(tier.policy.is_pinned(k) for k in keys_of(b))


def test_a_run_offered_again_is_not_pinned_again_and_only_what_changed_moves():
    """vLLM asks a waiting request's run at every step: the same offer pins nothing more; a longer or
    shorter one pins or lets go only the keys that joined or left, and each offer's keys stay pinned."""
    loads, tier, _ = ledger(["a", "b", "c", "d"], capacity=4)
    calls: list[tuple[str, str]] = []
    pin, unpin = tier.pin, tier.unpin
    tier.pin = lambda key: (calls.append(("pin", key)), pin(key))[1]
    tier.unpin = lambda key: (calls.append(("unpin", key)), unpin(key))[1]
    loads.promise("r", ["a", "b"])
    loads.promise("r", ["a", "b"])
    assert calls == [("pin", "a"), ("pin", "b")]
    loads.promise("r", ["a", "b", "c"])
    assert calls[2:] == [("pin", "c")]
    loads.promise("r", ["a"])
    assert sorted(calls[3:]) == [("unpin", "b"), ("unpin", "c")]
    assert tier.policy.is_pinned("a") and not any(tier.policy.is_pinned(k) for k in "bcd")
    loads.promise("r", [])
    assert not tier.policy.is_pinned("a")
