"""Confirmations on the step's reply (docs/tensor-parallel.md, "The protocol"): reports, their merge, their adoption.

The last tests run two rank processes with host-backed pools, as ``test_tp_protocol.py`` does
(the harness: ``tests/tp_cluster.py``). Each step's replies come back over pipes and are merged
the way vLLM's multiprocess executor merges its ranks' replies; the scheduler side starts from
the ranks' descriptions and adopts a group only from the merged reports, here with some replies
kept from the merger (the start-up state and the pinned host slots: ``test_tp_step_start.py``).
"""

from __future__ import annotations

import pickle

import pytest

from kvelastic.patches.executor_step_report import RANK_REPORT
from kvelastic.tp.report_merger import ReportMerger, attach_rank_report, step_report_of
from kvelastic.tp.step_report import CommandTally, RankReport, StepReport, split_map

WORLD = 2


def _report(rank: int, *maps: tuple[int, int], free: int = -1) -> RankReport:
    return RankReport(rank=rank, applied=0, step=0, maps=tuple(maps), device_free=free)


# ------------------------------------------------------------------ merging, no vLLM
def test_a_map_is_decided_by_the_least_count_once_every_rank_reported_it():
    tally = CommandTally(WORLD)
    assert tally.add(StepReport((_report(0, (5, 3)),))) == {}
    assert tally.undecided() == [5]
    assert tally.add(StepReport((_report(1, (5, 2), (6, 1)),))) == {5: 2}
    assert tally.undecided() == [6]
    assert split_map([10, 11, 12], 2) == ([10, 11], [12])


def test_a_report_from_outside_the_world_is_an_error():
    with pytest.raises(ValueError):
        CommandTally(WORLD).add(StepReport((_report(2, (1, 1)),)))


class _Output:
    """Stands for a ModelRunnerOutput where vLLM is not needed."""


def test_the_merger_keeps_a_report_that_came_on_empty_replies_for_the_next_one():
    merger = ReportMerger()
    assert merger.aggregate([None, None]) is None
    out = [attach_rank_report(_Output(), _report(r, (3, 1))) for r in range(WORLD)]
    merged = merger.aggregate(out, output_rank=1)
    assert merged is out[1] and {r.rank for r in step_report_of(merged).ranks} == {0, 1}


# --------------------------------------------------------- over vLLM's own outputs
vllm_outputs = pytest.importorskip("vllm.v1.outputs", reason="needs vllm installed")


def test_reports_ride_vllm_outputs_through_pickle_and_its_own_aggregator():
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput

    replies = []
    for rank in range(WORLD):
        output = ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(finished_sending={"req"}))
        replies.append(pickle.loads(pickle.dumps(attach_rank_report(output, _report(rank, (9, 4 - rank))))))
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, RANK_REPORT.name), "the shared empty output was changed"
    merged = ReportMerger(KVOutputAggregator(WORLD)).aggregate(replies, output_rank=0)
    assert merged.kv_connector_output.finished_sending == {"req"}, "the connector's own merge changed"
    assert CommandTally(WORLD).add(step_report_of(merged)) == {9: 3}
    empty = attach_rank_report(EMPTY_MODEL_RUNNER_OUTPUT, _report(0))
    assert empty is not EMPTY_MODEL_RUNNER_OUTPUT and not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, RANK_REPORT.name)


# ----------------------------------------------------- two rank processes
from tests.tp_cluster import allocate_within, cluster  # noqa: E402,F401 (cluster: a fixture)


def test_blocks_are_handed_out_only_once_both_ranks_reported_them(cluster):
    from tests.kv_fixtures import BLOCKS_PER_GROUP

    c = cluster()
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None
    c.step(deliver=[0])  # rank 1's reply never reaches the merger: nothing may be adopted
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None
    assert c.mapper.pending_groups, "a group was adopted on one rank's word"
    import time

    from kvelastic.tp.remote_mapper import MAX_REPORTS_WAITED, REFUSAL_BACKOFF_S

    for _ in range(MAX_REPORTS_WAITED + 1):  # rank 1's word on that map never comes: refused in the end
        assert c.allocate(3 * BLOCKS_PER_GROUP) is None, "a group was adopted on one rank's word"
        c.step()
    time.sleep(REFUSAL_BACKOFF_S)  # then asked for again, and confirmed by both
    blocks = allocate_within(c, 3 * BLOCKS_PER_GROUP)
    c.step(writes=[(b.block_id, 1) for b in blocks])  # each rank checks every block it writes is mapped


def test_a_rank_out_of_memory_is_a_scheduling_miss_and_the_other_gives_its_groups_back(cluster):
    from tests.kv_fixtures import BLOCKS_PER_GROUP

    c = cluster(limits=(None, 3))
    got = allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None
    c.step()  # rank 0 maps, rank 1 refuses: the least count wins
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None
    assert c.mapper.refused or c.mapper.pending_commands, "the refused groups must be given back"
    c.step(writes=[(b.block_id, 1) for b in got])
    c.bp.free_blocks(got)
    assert allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)


def test_a_map_never_reported_by_every_rank_is_refused_in_the_end(cluster):
    from kvelastic.tp.remote_mapper import MAX_REPORTS_WAITED
    from tests.kv_fixtures import BLOCKS_PER_GROUP

    c = cluster()
    assert c.allocate(2 * BLOCKS_PER_GROUP) is None
    for _ in range(MAX_REPORTS_WAITED + 2):
        c.step(deliver=[0])
    assert not c.mapper.pending_groups and c.mapper.refused, "an unconfirmed map stayed pending for ever"


def test_a_rank_runs_its_first_step_callbacks_once_when_the_first_step_arrives():
    """The rank's host tier starts pinning at the first step (after vLLM captured its CUDA graphs)."""
    from kvelastic.tp.protocol import StepPlan
    from kvelastic.tp.worker_side import start_rank
    from tests.kv_fixtures import build_cache

    _, _, cache = build_cache(None)
    worker = start_rank(cache, 0, WORLD, None, None)
    try:
        calls: list[str] = []
        worker.at_first_step(lambda: calls.append("pin"))
        assert calls == []  # start-up (graph capture) is not over yet
        worker.before_step(StepPlan(step=1))
        worker.before_step(StepPlan(step=2))
        assert calls == ["pin"]
        worker.at_first_step(lambda: calls.append("late"))  # after the first step: at once
        assert calls == ["pin", "late"]
    finally:
        worker.close()
