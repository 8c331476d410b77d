"""A rank maps a step's page groups after launching the step's forward pass (tp-step-protocol.md, point 7).

A MAP in step N's plan backs no block of step N: the scheduler hands out blocks only from
groups every rank confirmed, and a rank confirms a group (board or report) only once it has
mapped it. So each rank may run its driver calls while the GPU computes, after
``execute_model`` launched the forward, instead of in front of it. What must hold:
- the rule that picks those MAPs keeps in place any MAP a later command of its plan touches;
- the board's applied mark, the board's groups and the report never run ahead of a map;
- with vLLM's real scheduler (sync and async scheduling, board and step confirmations) every
  block a forward pass touches is mapped on every rank, while every plan's MAPs ran behind
  the launch of the forward stand-in (``RankProcesses.check_map_order``, which fails if they move
  back in front), and a rank out of memory is still a scheduling miss.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.tp import board as shm  # noqa: E402
from kvelastic.tp.protocol import (StepPlan, load_command, map_command, maps_after_launch,  # noqa: E402
                                   reserve_command, store_command, unmap_command, wait_command)
from tests.kv_fixtures import BLOCKS_PER_GROUP, GROUP_BYTES, WORLD, allocate_within, cluster  # noqa: E402,F401 (a fixture)
from tests.scheduler_harness import drive_async, make_requests  # noqa: E402
from tests.test_tp_real_scheduler import _forward, drive_ranks, tp_engine  # noqa: E402,F401 (a fixture)

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
def rank(tmp_path):
    from kvelastic.tp.worker_side import start_rank
    from tests.kv_fixtures import build_cache

    made = []

    def make(map_after_launch: bool = True):
        pool, _, cache = build_cache(None)
        worker = start_rank(cache, tmp_path, 0, 1, None, None, map_after_launch=map_after_launch)
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
    assert not pool.is_mapped(5) and worker.board.groups[5] == 0, "the map ran in front of the forward"
    assert worker.applied == 3, "the applied mark passed a map not yet made"
    assert worker.take_report().maps == (), "a report claimed a map not yet made"
    worker.after_step(plan)  # the forward is launched
    assert pool.is_mapped(5) and pool.is_mapped(6) and list(worker.board.groups[5:7]) == [4, 4]
    assert worker.applied == 4 and worker.board.get(shm.STEPS_DONE) == 2
    assert worker.take_report().maps == ((4, 2),)


def test_with_the_setting_off_a_rank_maps_in_front_of_the_forward(rank):
    worker, pool = rank(map_after_launch=False)
    plan = StepPlan(step=1, commands=(map_command(2, [5]),))
    worker.before_step(plan)
    assert pool.is_mapped(5) and worker.board.groups[5] == 2 and worker.applied == 2


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
    assert not pool.is_mapped(5) and worker.board.groups[5] == 0 and worker.applied == 3


# ------------------------------------------------- two spawned ranks, vLLM's real scheduler


@pytest.mark.parametrize("after", [True, False])
def test_blocks_come_once_every_rank_mapped_them_behind_the_launch(cluster, after):
    """The ordering check itself: with the setting off the same run shows the maps in front."""
    c = cluster(map_after_launch=after)
    blocks = allocate_within(c, 3 * BLOCKS_PER_GROUP)
    c.step(writes=[(b.block_id, 7) for b in blocks])
    c.step(checks=[(b.block_id, 7) for b in blocks])
    ran = (c.maps_before_launch, c.maps_after_launch)
    assert (ran[0] == 0 and ran[1] >= WORLD) if after else (ran[0] >= WORLD and ran[1] == 0), ran
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


def test_the_real_scheduler_with_maps_in_front_still_keeps_every_block_right(tp_engine):
    scheduler, ranks = tp_engine(limit_groups=3, cpu_bytes=16 * GROUP_BYTES * WORLD, map_after_launch=False)
    drive_ranks(scheduler, ranks, [make_requests("a", 4, 320, 0, seed=0), make_requests("b", 4, 320, 0, seed=0)])


@pytest.mark.parametrize("confirm", ["board", "step"])
def test_async_scheduling_hands_out_only_blocks_every_rank_mapped(tp_engine, confirm):
    """Step N+1 is scheduled before step N's output is read; each rank checks every block written is mapped."""
    from kvelastic.tp.report_merger import STEP_ATTR, ReportMerger

    scheduler, ranks = tp_engine(limit_groups=6, confirm=confirm)

    def forward(s, out):
        ranks.send(out.kvelastic_plan, _forward(s, out)[0])  # writes only: an async step's tokens come later
        if not out.kvelastic_plan.report:
            return None
        merger = ReportMerger()
        assert merger.aggregate(ranks.launched, output_rank=0) is None
        sampled = merger.aggregate([types.SimpleNamespace() for _ in range(WORLD)], output_rank=0)
        return {STEP_ATTR: getattr(sampled, STEP_ATTR)}

    waves = [make_requests("a", 4, 320, 0, seed=0), make_requests("c", 8, 300, 0, seed=1)]
    trace = drive_async(scheduler, waves, max_steps=3000, forward=forward)
    assert {rid for step in trace for rid, _ in step} == {r.request_id for wave in waves for r in wave}
    assert ranks.maps_after_launch >= WORLD
    ranks.check_map_order()
