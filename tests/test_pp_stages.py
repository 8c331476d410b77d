"""Pipeline parallelism: two stages holding different layers, each a rank of the TP protocol.

A pipeline stage holds only its own layers' KV tensors, so its page groups have
other sizes than the other stage's, but the same blocks. Each stage is a spawned
process with its own host-backed pool and :class:`RankWorker` (stage 0 holds one
layer, stage 1 two); vLLM broadcasts every step's output to every stage, and the
stages map, confirm and unmap exactly as tensor-parallel ranks do. Every block a
"forward pass" touches is checked on both stages, so a block handed out before
both stages mapped it, or unmapped while in use, fails.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.errors import PatchError  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from kvelastic.startup.runtime import Runtime  # noqa: E402
from kvelastic.tp import board as shm  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP, N, PAGE  # noqa: E402
from tests.scheduler_harness import build_patched, make_requests, make_scheduler, vllm_config  # noqa: E402
from tests.test_tp_protocol import WORLD, RankProcesses, allocate_within  # noqa: E402
from tests.test_tp_real_scheduler import drive_ranks, drive_ranks_step  # noqa: E402

STAGE_LAYERS = (1, 2)  # the first stage the smaller: the scheduler must not take its sizes for all


def _group_bytes(layers: int) -> int:
    return 2 * layers * PAGE


# ------------------------------------------------------------- the protocol, stage by stage
@pytest.fixture
def stages(tmp_path):
    from tests.test_tp_protocol import Cluster

    made = []

    def make(**kw):
        made.append(Cluster(tmp_path, layers=STAGE_LAYERS, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_the_scheduler_counts_each_group_at_the_larger_stage_and_a_slot_holds_both_shares(stages):
    c = stages(cpu_bytes=1 << 20)
    assert c.cache.group_bytes == _group_bytes(max(STAGE_LAYERS))
    infos = [shm.read_info(c.folder, r) for r in range(WORLD)]
    assert [i.group_bytes for i in infos] == [_group_bytes(n) for n in STAGE_LAYERS]
    assert c.connection.slot_bytes == sum(i.slot_bytes for i in infos)
    assert c.connection.host_slots == min(i.host_slots for i in infos) > 0


def test_blocks_are_handed_out_only_once_both_stages_mapped_them(stages):
    c = stages()
    got = allocate_within(c, 3 * BLOCKS_PER_GROUP)
    groups = {c.cache.group_of_block(b.block_id) for b in got}
    assert groups <= c.mapper.mapped_groups
    c.step(writes=[(b.block_id, 7) for b in got])
    c.step(checks=[(b.block_id, 7) for b in got])  # both stages still hold what their layers wrote
    per_stage = [m // g for m, g in zip(c.mapped_bytes, map(_group_bytes, STAGE_LAYERS))]
    assert per_stage == [len(c.mapper.mapped_groups)] * 2 and len(c.mapper.mapped_groups) >= len(groups)


def test_a_stage_out_of_memory_is_a_scheduling_miss_and_the_other_gives_its_groups_back(stages):
    c = stages(limits=(None, 3))  # stage 1 has room for 3 groups of its own (the null group's included)
    got = allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None
    c.step()  # stage 0 maps the extra groups, stage 1 refuses them
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None, "a group refused by one stage must not be handed out"
    c.step()
    assert [m // g for m, g in zip(c.mapped_bytes, map(_group_bytes, STAGE_LAYERS))] == [3, 3]
    c.step(writes=[(b.block_id, 5) for b in got], checks=[])
    c.bp.free_blocks(got)
    assert allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)  # the engine keeps serving within what fits


def test_a_dead_stage_is_noticed_and_never_waited_for(stages):
    c = stages()
    allocate_within(c, BLOCKS_PER_GROUP)
    os.kill(c.procs[1].pid, signal.SIGKILL)
    c.procs[1].join(10)
    c.mapper._next_liveness = 0.0
    started = time.monotonic()
    assert c.allocate(6 * BLOCKS_PER_GROUP) is None
    c.step(live=[0])
    c.mapper._next_liveness = 0.0
    assert c.allocate(6 * BLOCKS_PER_GROUP) is None
    assert c.mapper.dead_ranks == {1}
    assert time.monotonic() - started < 5


# ------------------------------------------------------------ vLLM's real scheduler, PP=2
def _scheduler_with_stages(stages: int):
    config = vllm_config(N)
    parallel = config.parallel_config
    previous = (parallel.world_size, parallel.pipeline_parallel_size, parallel.distributed_executor_backend)
    parallel.world_size, parallel.pipeline_parallel_size, parallel.distributed_executor_backend = stages, stages, "mp"
    try:
        return make_scheduler()
    finally:
        parallel.world_size, parallel.pipeline_parallel_size, parallel.distributed_executor_backend = previous


@pytest.fixture
def pp_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    made: list = []

    def make(pipeline: str = "allow", confirm: str = "board", limit_groups: int | None = None,
             cpu_bytes: int | None = None):
        ranks = RankProcesses(shm.engine_dir(os.getpid()), (limit_groups, limit_groups), cpu_bytes, STAGE_LAYERS)
        made.append(ranks)
        runtime = Runtime(Settings(enabled=True, pipeline=pipeline, tp_confirm=confirm, cpu_bytes=cpu_bytes))
        scheduler, patcher = build_patched(runtime, lambda: _scheduler_with_stages(WORLD))
        made.append((scheduler, patcher))
        return scheduler, ranks

    yield make
    for thing in made:
        if isinstance(thing, RankProcesses):
            thing.close()
        else:
            scheduler, patcher = thing
            scheduler.kvelastic_reclaimer.stop()
            patcher.revert()


def test_pipeline_parallelism_is_refused_unless_allowed():
    """The refusal itself: tests/test_mapper_reclaimer.py; here the setting and its message."""
    assert Settings().pipeline == "refuse" and Settings.from_env({"KVELASTIC_PIPELINE": "allow"}).pipeline == "allow"
    with pytest.raises(Exception, match="KVELASTIC_PIPELINE"):
        Settings.from_env({"KVELASTIC_PIPELINE": "yes"})


@pytest.mark.parametrize("confirm", ["board", "step"])
def test_every_block_holds_its_tokens_data_on_both_stages(pp_engine, confirm):
    scheduler, ranks = pp_engine(confirm=confirm)
    waves = [make_requests("a", 6, 300, 200, seed=0), make_requests("c", 8, 460, 0, seed=1)]
    if confirm == "step":
        trace = drive_ranks_step(scheduler, ranks, waves, [], set())
    else:
        trace = drive_ranks(scheduler, ranks, waves)
    assert {rid for step in trace for rid, _ in step} == {r.request_id for wave in waves for r in wave}


def test_spills_and_reloads_keep_every_block_right_on_both_stages(pp_engine):
    scheduler, ranks = pp_engine(limit_groups=3, cpu_bytes=16 * _group_bytes(sum(STAGE_LAYERS)))
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
    drive_ranks(scheduler, ranks, [make_requests("a", 4, 320, 0, seed=0), *filler,
                                   make_requests("b", 4, 320, 0, seed=0)])
    assert scheduler.kvelastic_offload.tier.hits >= 40, "the second pass of a's prompts did not come back from the host"
