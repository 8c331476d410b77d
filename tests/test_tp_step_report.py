"""Confirmations on the step's reply (docs/tp-step-protocol.md): reports, their merge, their adoption.

The last tests spawn two ranks with host-backed pools, as ``test_tp_protocol.py`` does. Each
step's reply comes back pickled as a ``ModelRunnerOutput`` and is merged the way vLLM's
multiprocess executor merges its ranks' replies. The scheduler side has no board: the ranks'
board files are removed before it connects, so it starts from their descriptions and adopts a
group only from the merged reports (the start-up state and the pinned host slots:
``test_tp_step_start.py``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import types

import pytest

from kvelastic.tp.report_merger import RANK_ATTR, ReportMerger, attach_rank_report, step_report_of
from kvelastic.tp.step_report import CommandTally, RankReport, StepReport, split_map
from tests.kv_fixtures import allocate_or_ask, allocate_within, closed_after

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
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, RANK_ATTR), "the shared empty output was changed"
    merged = ReportMerger(KVOutputAggregator(WORLD)).aggregate(replies, output_rank=0)
    assert merged.kv_connector_output.finished_sending == {"req"}, "the connector's own merge changed"
    assert CommandTally(WORLD).add(step_report_of(merged)) == {9: 3}
    empty = attach_rank_report(EMPTY_MODEL_RUNNER_OUTPUT, _report(0))
    assert empty is not EMPTY_MODEL_RUNNER_OUTPUT and not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, RANK_ATTR)


# ----------------------------------------------------- two rank processes, no board
def rank_main(conn, folder: str, rank: int, limit_groups, start_groups=(), host_slots: int = 0) -> None:
    """A worker rank: apply each plan; on a report step, answer execute_model with its report.

    ``start_groups``: groups it maps before it serves (as vLLM's start-up may); ``host_slots``: its share of
    a host tier, pinned chunk by chunk as the test says (``("pin", chunks, slots)``: answered once at least
    ``slots`` are pinned), the driver's pinning being the one thing stood in for (:mod:`tests.host_pins`)."""
    from pathlib import Path

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from kvelastic.tp.worker_side import start_rank
    from patches.worker_execute_model import _execute
    from tests.host_pins import GatedHostShare
    from tests.kv_fixtures import build_cache

    pool, views, cache = build_cache(limit_groups)
    cache.map_groups(start_groups)
    gate = GatedHostShare() if host_slots else None
    cpu_bytes = gate.cpu_bytes(cache, host_slots, WORLD) if gate else None
    worker = start_rank(cache, Path(folder), rank, WORLD, None, cpu_bytes)
    runtime = types.SimpleNamespace(rank_worker=worker)
    conn.send("ready")
    while True:
        message = conn.recv()
        if message == "stop":
            break
        if message[0] == "pin":
            conn.send(("pinned", gate.pin(message[1], message[2])))
            continue
        plan, writes = message

        def forward(_scheduler_output) -> None:  # the step's writes as its forward pass is launched
            for block_id in writes:
                assert pool.is_mapped(cache.group_of_block(block_id)), f"write to unmapped block {block_id}"
                for view in views:
                    view[:, block_id].fill_(rank + 1)

        # through patches/worker_execute_model.py: the report in place of execute_model's None, then
        # sample_tokens' output (here vLLM's empty one)
        launched = _execute(runtime, forward, None, (types.SimpleNamespace(kvelastic_plan=plan),), {})
        conn.send((launched, EMPTY_MODEL_RUNNER_OUTPUT))
    if gate is not None:
        gate.open()
    worker.close()
    pool.close()


def remove_boards(folder, world: int = WORLD) -> None:
    """Take the ranks' board files away from the scheduler (each rank keeps writing its own mapping)."""
    for rank in range(world):
        (folder / f"rank{rank}.board").unlink()


class StepCluster:
    """The scheduler side in STEP mode plus two spawned ranks; replies merged as vLLM's executor would.

    The ranks' boards are gone before the scheduler connects: it has only their descriptions and replies.
    ``start_groups``: each rank's groups mapped before it serves; ``host_slots``: each rank's gated host
    share (:meth:`pin`)."""

    def __init__(self, tmp_path, limits=(None, None), start_groups=((), ()), host_slots: int = 0):
        from vllm.v1.core.block_pool import BlockPool

        from kvelastic.hooks.block_pool import make_page_aware
        from kvelastic.tp import board as shm
        from kvelastic.tp.remote_mapper import STEP
        from kvelastic.tp.scheduler_side import RankConnection
        from tests.kv_fixtures import BS, N
        from tests.scheduler_harness import scheduler_patcher

        folder = tmp_path / "engine"
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(WORLD):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(child, str(folder), rank, limits[rank], start_groups[rank],
                                                       host_slots), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.poll(240) and conn.recv() == "ready"
        self.folder = folder
        self.infos = [shm.read_info(folder, r) for r in range(WORLD)]
        remove_boards(folder)
        self.connection = RankConnection(folder, self.infos, confirm=STEP)
        self.cache, self.mapper = self.connection.cache, self.connection.mapper
        assert self.mapper.boards == [], "the scheduler opened a board in STEP mode"
        self.bp = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
        self.queue = make_page_aware(self.bp, self.cache, self.mapper, patcher=scheduler_patcher(),
                                     max_ahead_groups=2)

    def step(self, writes=(), deliver=range(WORLD), report: bool = False) -> StepReport | None:
        """One step; the replies of the ranks in ``deliver`` reach the merger (vLLM waits for all of them).
        ``report``: make it a report step whatever the scheduler asked. Returns the report adopted, if any."""
        plan = self.mapper.take_plan()
        if report:
            plan = dataclasses.replace(plan, report=True)
        for conn in self.conns:
            conn.send((plan, list(writes)))
        replies = []
        for rank, conn in enumerate(self.conns):
            assert conn.poll(30), f"rank {rank} did not answer"
            replies.append(conn.recv() if rank in deliver else None)
        if plan.report:  # the executor's two calls of the step, one merger (patches/executor_step_report.py)
            kept = [r for r in replies if r is not None]
            merger = ReportMerger()
            if kept:
                assert merger.aggregate([launched for launched, _ in kept], output_rank=0) is None
                sampled = merger.aggregate([pickle.loads(pickle.dumps(out)) for _, out in kept], output_rank=0)
            merged = step_report_of(sampled) if kept else None
            self.mapper.adopt(merged or StepReport())
            return merged
        return None

    def pin(self, rank: int, chunks: int, slots: int) -> tuple[int, bool]:
        """Let rank ``rank`` pin ``chunks`` more chunks of its host share; (ready, settled) once ``slots`` are."""
        self.conns[rank].send(("pin", chunks, slots))
        assert self.conns[rank].poll(150), f"rank {rank} did not pin"
        tag, state = self.conns[rank].recv()
        assert tag == "pinned"
        return state

    def allocate(self, n: int):
        return allocate_or_ask(self.bp, self.queue, n)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                conn.send("stop")
            proc.join(10)


@pytest.fixture
def step_cluster(tmp_path):
    yield from closed_after(lambda **kw: StepCluster(tmp_path, **kw))


def test_blocks_are_handed_out_only_once_both_ranks_reported_them(step_cluster):
    from tests.kv_fixtures import BLOCKS_PER_GROUP

    c = step_cluster()
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None
    c.step(deliver=[0])  # rank 1's reply never reaches the merger: nothing may be adopted
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None
    assert c.mapper.pending_groups, "a group was adopted on one rank's word"
    from kvelastic.tp.remote_mapper import MAX_REPORTS_WAITED

    blocks = allocate_within(c, 3 * BLOCKS_PER_GROUP, steps=MAX_REPORTS_WAITED + 6)  # refused, then asked again
    c.step(writes=[b.block_id for b in blocks])  # each rank checks every block it writes is mapped


def test_a_rank_out_of_memory_is_a_scheduling_miss_and_the_other_gives_its_groups_back(step_cluster):
    from tests.kv_fixtures import BLOCKS_PER_GROUP

    c = step_cluster(limits=(None, 3))
    got = allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None
    c.step()  # rank 0 maps, rank 1 refuses: the least count wins
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None
    assert c.mapper.refused or c.mapper.pending_commands, "the refused groups must be given back"
    c.step(writes=[b.block_id for b in got])
    c.bp.free_blocks(got)
    assert allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)


def test_a_map_never_reported_by_every_rank_is_refused_in_the_end(step_cluster):
    from kvelastic.tp.remote_mapper import MAX_REPORTS_WAITED
    from tests.kv_fixtures import BLOCKS_PER_GROUP

    c = step_cluster()
    assert c.allocate(2 * BLOCKS_PER_GROUP) is None
    for _ in range(MAX_REPORTS_WAITED + 2):
        c.step(deliver=[0])
    assert not c.mapper.pending_groups and c.mapper.refused, "an unconfirmed map stayed pending for ever"


def test_a_rank_runs_its_first_step_callbacks_once_when_the_first_step_arrives(tmp_path):
    """The rank's host tier starts pinning at the first step (after vLLM captured its CUDA graphs)."""
    from kvelastic.tp.protocol import StepPlan
    from kvelastic.tp.worker_side import start_rank
    from tests.kv_fixtures import build_cache

    _, _, cache = build_cache(None)
    worker = start_rank(cache, tmp_path, 0, WORLD, None, None)
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
