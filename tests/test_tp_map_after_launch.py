"""A rank maps a step's page groups after launching the step's forward pass.

A MAP in step N's plan backs no block of step N: the scheduler hands out blocks only from
groups every rank confirmed, and a rank confirms a group (on its report) only once it has
mapped it. So each rank runs its driver calls while the GPU computes, after
``execute_model`` launched the forward, instead of in front of it. What must hold:
- the rule that picks those MAPs keeps in place any MAP a later command of its plan touches;
- the applied mark and the report never run ahead of a map;
- with vLLM's real scheduler (sync and async scheduling) every block a forward pass touches is
  mapped on every rank, while every plan's MAPs ran behind the launch of the forward stand-in
  (``RankProcesses.check_map_order``, which fails if they move back in front), and a rank out
  of memory is still a scheduling miss.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.tp.protocol import (StepPlan, load_command, map_command, maps_after_launch,  # noqa: E402
                                   reserve_command, store_command, unmap_command, wait_command)
from tests.kv_fixtures import BLOCKS_PER_GROUP, WORLD  # noqa: E402
from tests.scheduler_harness import drive_async, make_requests  # noqa: E402
from tests.test_tp_real_scheduler import step_to_ranks, tp_engine  # noqa: E402,F401 (a fixture)
from tests.tp_cluster import allocate_within, cluster  # noqa: E402,F401 (a fixture)

BLOCKS = 4  # blocks per group in the rule's tests


def group_of(block_id: int) -> int:
    return block_id // BLOCKS


# ------------------------------------------------------------------ the rule, no ranks
def test_maps_that_no_later_command_touches_wait_for_the_launch():
    plan = (unmap_command(5, [1]), map_command(6, [2, 3]), store_command(7, [0, 4], [0, 1], True),
            load_command(8, [20], [2]), wait_command(9), reserve_command(10, 4), map_command(11, [7]))
    assert maps_after_launch(plan, group_of) == {6, 11}


@pytest.mark.parametrize("later", [unmap_command(6, [3]),             # a dead rank's refusals follow their MAP
                                   load_command(6, [13], [0]),        # a load into a block of group 3
                                   store_command(6, [12], [0], True),  # a spill of a block of group 3
                                   map_command(6, [3])])               # mapped twice: keep the two in order
def test_a_map_whose_groups_a_later_command_touches_keeps_its_place(later):
    assert maps_after_launch((map_command(5, [2, 3]), later), group_of) == ({6} if later[1] == "map" else set())


def test_a_map_kept_in_place_keeps_every_earlier_map_of_its_groups_in_place_too():
    plan = (map_command(4, [1]), map_command(5, [2]), unmap_command(6, [9]), map_command(7, [2]),
            unmap_command(8, [2]))
    assert maps_after_launch(plan, group_of) == {4}


def test_a_plan_without_a_map_is_not_walked():
    def never(_):
        raise AssertionError("a plan without a MAP looked its blocks up")

    assert maps_after_launch((store_command(3, [1, 2], [0, 1], True), unmap_command(4, [0])), never) == set()


# ------------------------------------------------------------ one rank, in this process
@pytest.fixture
def rank():
    from kvelastic.tp.worker_side import start_rank
    from tests.kv_fixtures import build_cache

    made = []

    def make():
        pool, _, cache = build_cache(None)
        worker = start_rank(cache, 0, 1, None, None)
        made.append((worker, pool))
        return worker, pool

    yield make
    for worker, pool in made:
        worker.close()
        pool.close()


def test_a_rank_confirms_a_map_only_once_it_made_it_behind_the_launch(rank):
    worker, pool = rank()
    first = StepPlan(step=1, commands=(map_command(2, [4]),))
    worker.before_step(first)
    worker.after_step(first)
    plan = StepPlan(step=2, commands=(unmap_command(3, [4]), map_command(4, [5, 6])))
    worker.take_report()
    worker.before_step(plan)
    assert not pool.is_mapped(4), "the unmap must run in front of the forward"
    assert not pool.is_mapped(5), "the map ran in front of the forward"
    assert worker.applied == 3, "the applied mark passed a map not yet made"
    assert worker.take_report().maps == (), "a report claimed a map not yet made"
    worker.after_step(plan)  # the forward is launched
    assert pool.is_mapped(5) and pool.is_mapped(6)
    assert worker.applied == 4 and worker.steps_done == 2
    report = worker.take_report()
    assert report.maps == ((4, 2),) and (report.applied, report.step) == (4, 2)


def test_a_map_then_an_unmap_of_its_group_in_one_plan_stay_in_order(rank):
    """A rank found dead makes the scheduler refuse the groups still pending, whose MAP may not have left yet."""
    worker, pool = rank()
    plan = StepPlan(step=1, commands=(map_command(2, [5, 6]), unmap_command(3, [6]), map_command(4, [7])))
    worker.before_step(plan)
    assert pool.is_mapped(5) and not pool.is_mapped(6) and not pool.is_mapped(7)
    assert worker.maps_kept_in_order == 1 and worker.applied == 3
    worker.after_step(plan)
    assert pool.is_mapped(5) and not pool.is_mapped(6) and pool.is_mapped(7), "the unmapped group came back"
    assert worker.applied == 4


def test_maps_left_by_a_step_whose_forward_failed_run_before_the_next_step(rank):
    worker, pool = rank()
    worker.before_step(StepPlan(step=1, commands=(map_command(2, [5]),)))  # execute_model raised: no after_step
    assert not pool.is_mapped(5)
    worker.before_step(StepPlan(step=2, commands=(unmap_command(3, [5]),)))
    assert not pool.is_mapped(5) and worker.applied == 3


# ------------------------------------------------- two rank processes, vLLM's real scheduler


def test_blocks_come_once_every_rank_mapped_them_behind_the_launch(cluster):
    c = cluster()
    blocks = allocate_within(c, 3 * BLOCKS_PER_GROUP)
    c.step(writes=[(b.block_id, 7) for b in blocks])
    c.step(checks=[(b.block_id, 7) for b in blocks])
    assert c.maps_before_launch == 0 and c.maps_after_launch >= WORLD, (c.maps_before_launch, c.maps_after_launch)
    c.check_map_order()


def test_a_rank_out_of_memory_is_still_a_scheduling_miss(cluster):
    c = cluster(limits=(None, 3))
    got = allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None
    c.step()  # both ranks map behind the launch; rank 1 refuses
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None, "a group refused by one rank must not be handed out"
    c.step(writes=[(b.block_id, 5) for b in got])
    assert c.maps_before_launch == 0 and c.maps_after_launch >= WORLD
    c.bp.free_blocks(got)
    assert allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)


def test_async_scheduling_hands_out_only_blocks_every_rank_mapped(tp_engine):
    """Step N+1 is scheduled before step N's output is read; each rank checks every block written is mapped."""
    scheduler, ranks = tp_engine(limit_groups=6)

    def forward(s, out):  # writes only: an async step's tokens come later
        return step_to_ranks(s, ranks, out, writes_only=True)

    waves = [make_requests("a", 4, 320, 0, seed=0), make_requests("c", 8, 300, 0, seed=1)]
    trace = drive_async(scheduler, waves, max_steps=3000, forward=forward)
    assert {rid for step in trace for rid, _ in step} == {r.request_id for wave in waves for r in wave}
    assert ranks.maps_after_launch >= WORLD
    ranks.check_map_order()
