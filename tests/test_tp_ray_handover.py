"""A multiprocess executor's ranks describe themselves over vLLM's collective_rpc; Ray's learn who drives them.

The engine core is this test process. The ranks are processes that are not its
children (as a Ray actor's parent is the raylet), started from
``tests/tp_ranks.py``'s forkserver. vLLM's real ``MultiprocExecutor`` (the base
of Ray's V2 executor) drives them, patched by ``executor_handover``: only its
message queues are stood in for, by pipes to the ranks, which run each call the
way vLLM's ``WorkerProc`` does. Checked: every rank's description comes back on
its reply and the scheduler connects from those alone (no rank writes a file);
a Ray rank that no engine core spoke to fails with a clear error; the refusals
(Ray v1, a vLLM whose engine loop cannot be woken) stop start-up before any
rank hears anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.executor.multiproc_executor", reason="needs vllm installed")

from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc  # noqa: E402

from kvelastic.errors import PatchError  # noqa: E402
from kvelastic.patches import executor_handover, executor_step_report  # noqa: E402
from kvelastic.patching.versions import Version, installed_vllm_version  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from kvelastic.tp import executor_handover as handover  # noqa: E402
from kvelastic.tp.handovers import RankHandovers  # noqa: E402
from kvelastic.tp.protocol import MAP, START_SEQ, UNMAP  # noqa: E402
from kvelastic.tp.rank_info import RankInfo, encode_info  # noqa: E402
from kvelastic.tp.report_merger import step_report_of  # noqa: E402
from kvelastic.tp.step_report import CommandTally  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP  # noqa: E402
from tests.scheduler_harness import applied_patch  # noqa: E402
from tests.tp_ranks import ray_rank_main, rank_context  # noqa: E402

WORLD = 2
TIMEOUT_S = 120
#: The groups each rank maps before it serves (the null group 0 aside): group 1 on both, group 2 on rank 0 only.
START_GROUPS = ((1, 2), (1,))
STATUS = {"ok": WorkerProc.ResponseStatus.SUCCESS, "failed": WorkerProc.ResponseStatus.FAILURE}


# ------------------------------------------------------------------ the engine core (this process)
class Broadcast:
    def __init__(self, pipes) -> None:
        self.pipes = pipes

    def enqueue(self, item: tuple) -> None:
        for pipe in self.pipes:
            pipe.send(item)


class Replies:
    """One rank's response queue: its answers, with vLLM's own status values."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe

    def dequeue(self, timeout=None, **_):
        if not self.pipe.poll(TIMEOUT_S if timeout is None else timeout):
            raise TimeoutError("no reply from the rank")
        status, result = self.pipe.recv()
        return STATUS[status], result


def _executor(to_ranks, from_ranks, backend: str = "ray", stages: int = 1) -> MultiprocExecutor:
    ex = object.__new__(MultiprocExecutor)  # no worker processes of vLLM's: the pipes stand for its queues
    ex.rpc_broadcast_mq, ex.response_mqs = Broadcast(to_ranks), [Replies(p) for p in from_ranks]
    ex.futures_queue, ex.is_failed, ex.output_rank = deque(), False, 0
    ex.kv_output_aggregator = ex.ec_output_aggregator = None
    parallel = SimpleNamespace(distributed_executor_backend=backend, pipeline_parallel_size=stages,
                               enable_fault_tolerance=False)
    ex.vllm_config = SimpleNamespace(parallel_config=parallel, compilation_config=SimpleNamespace())
    return ex


def _runtime(settings: Settings | None = None) -> SimpleNamespace:
    """What the patches and the scheduler side read of the engine core's Runtime: its settings and the record
    of what the executor learnt from its ranks."""
    return SimpleNamespace(settings=settings or Settings(), rank_handovers=RankHandovers())


def _scheduler_side(runtime: SimpleNamespace, backend: str = "ray"):
    """The engine core's scheduler side as ``attach_scheduler`` connects it (``connect_ranks``), in front of
    vLLM's BlockPool made page-aware: (connection, block pool, queue)."""
    from vllm.v1.core.block_pool import BlockPool

    from kvelastic.hooks.block_pool import make_page_aware
    from kvelastic.tp.scheduler_side import connect_ranks
    from tests.kv_fixtures import BS, N
    from tests.scheduler_harness import scheduler_patcher

    parallel = SimpleNamespace(world_size=WORLD, pipeline_parallel_size=1, distributed_executor_backend=backend)
    connection = connect_ranks(SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel)),
                               runtime, contextlib.nullcontext())
    pool = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    queue = make_page_aware(pool, connection.cache, connection.mapper, patcher=scheduler_patcher(),
                            max_ahead_groups=2)
    return connection, pool, queue


@contextlib.contextmanager
def rank_processes(hosts: dict | None = None, backend: str = "ray", vllm_run_method: bool = False):
    """WORLD rank processes, none of them a child of this one: (pipes to them, pipes from them).
    ``hosts``: rank -> the host identity it finds for itself (absent: this host's)."""
    context = rank_context()
    hosts = hosts or {}
    inboxes = [context.Pipe() for _ in range(WORLD)]
    outboxes = [context.Pipe() for _ in range(WORLD)]
    ranks = [context.Process(target=ray_rank_main, args=(r, WORLD, inboxes[r][1], outboxes[r][0], hosts.get(r),
                                                         START_GROUPS[r], vllm_run_method, backend), daemon=True)
             for r in range(WORLD)]
    for process in ranks:
        process.start()
    to_ranks, from_ranks = [i[0] for i in inboxes], [o[1] for o in outboxes]
    try:
        yield to_ranks, from_ranks
    finally:
        for pipe in to_ranks:
            pipe.send(None)
        for process in ranks:
            process.join(TIMEOUT_S)
            if process.is_alive():
                process.kill()


@pytest.fixture
def shared_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    return tmp_path


def map_and_write_on_every_rank(executor, connection, pool, queue) -> list:
    """From a connection made from the descriptions alone: the start-up state adopted, a report step hearing
    every rank, blocks handed out only from the groups every rank reported, each rank's writes landing in mapped
    groups, and both ranks then holding the same bytes."""
    mapper, adopt = connection.mapper, connection.reply_hook()
    assert mapper.mapped_groups == {0, 1}, "the groups both ranks mapped at start-up were not adopted"
    confirmed = set(mapper.mapped_groups)
    want = 3 * BLOCKS_PER_GROUP
    assert pool.get_num_free_blocks() == 2 * BLOCKS_PER_GROUP - 1  # groups 0 and 1 but the null block
    queue.want_blocks(want)  # vLLM's scheduling miss
    plan = mapper.take_plan()
    maps = {c[0]: c[2] for c in plan.commands if c[1] == MAP}
    assert plan.commands[0] == (START_SEQ + 1, UNMAP, (2,)), "rank 0's lone group 2 must go first"
    assert plan.report and maps, "a step carrying maps must ask every rank for its report"
    assert executor.execute_model(SimpleNamespace(kvelastic_plan=plan, writes=[])) is None
    output = executor.sample_tokens(None)
    report = step_report_of(output)
    assert report is not None and sorted(r.rank for r in report.ranks) == list(range(WORLD))
    assert pool.get_num_free_blocks() < want, "groups were adopted before the step's replies were"
    adopt(output)  # as update_from_output does
    for seq, done in CommandTally(WORLD).add(report).items():
        confirmed.update(maps[seq][:done])
    assert pool.get_num_free_blocks() >= want, "the groups both ranks reported mapped were not adopted"
    blocks = pool.get_new_blocks(want)
    assert {connection.cache.group_of_block(b.block_id) for b in blocks} <= confirmed
    writes = dataclasses.replace(mapper.take_plan(), report=True)  # every rank answers: each checks its writes
    assert executor.execute_model(SimpleNamespace(kvelastic_plan=writes, writes=[b.block_id for b in blocks])) \
        is None
    after = step_report_of(executor.sample_tokens(None))
    held = {r.rank: r.mapped_bytes for r in after.ranks}
    assert held[0] == held[1], f"the ranks map different groups after the first step: {held}"
    return blocks


def _files_under(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.mark.parametrize("backend", ["ray", "mp"])
def test_ranks_describe_themselves_on_the_replies_and_the_scheduler_connects_from_those_alone(shared_dir, backend):
    """Through vLLM's own ``run_method`` on the ranks: the engine core's word (Ray only), vLLM's call in which the
    ranks make their caches, then their descriptions on the replies, decoded and kept in rank order. The scheduler
    adopts their start-up state from those, a report step hears every rank, and nothing was written to the shared
    folder by any of them."""
    runtime = _runtime()
    with rank_processes(backend=backend, vllm_run_method=backend == "ray") as (to_ranks, from_ranks), \
            applied_patch(executor_handover, runtime), applied_patch(executor_step_report, None):
        executor = _executor(to_ranks, from_ranks, backend=backend)
        executor.initialize_from_config([])  # patched: the word (Ray), vLLM's own calls, the descriptions
        described = runtime.rank_handovers.described()
        assert described is not None and [info.rank for info in described] == list(range(WORLD))
        assert {info.pid for info in described}.isdisjoint({os.getpid()})  # not this process's children
        assert [info.start_groups for info in described] == [(0, 1, 2), (0, 1)]
        connection, pool, queue = _scheduler_side(runtime, backend)
        map_and_write_on_every_rank(executor, connection, pool, queue)
    assert _files_under(shared_dir) == [], "a rank or the scheduler wrote to the shared folder"


def test_without_the_engine_cores_word_a_ray_rank_fails_with_a_clear_error(shared_dir):
    with rank_processes() as (to_ranks, from_ranks):
        executor = _executor(to_ranks, from_ranks)
        with pytest.raises(RuntimeError, match="EngineCoreUnknown.*was told by no engine core") as caught:
            executor.collective_rpc("initialize_from_config")  # vLLM's call, no kvelastic wrap in front
    assert f"its parent (pid {os.getpid()})" not in str(caught.value)  # the rank is no child of the engine core
    assert "KVELASTIC=1 there" in str(caught.value)


def test_descriptions_sent_back_are_kept_only_when_each_rank_sent_its_own():
    from kvelastic.pool.kv_layout import BlockRuns, KVGroupLayout

    layout = KVGroupLayout([BlockRuns(0, 4096, ((0, 8),))], num_blocks=8, page_bytes=8192, blocks_per_group=2)

    def sent(rank: int) -> bytes:
        return encode_info(RankInfo(rank=rank, world=WORLD, pid=100 + rank, layout=layout, group_bytes=8192,
                                    page_bytes=8192, limit_bytes=None, host_slots=0, slot_bytes=0))

    for replies, kept in (([sent(1), sent(0)], [100, 101]), ([sent(0), None], None), ([sent(1), sent(1)], None)):
        handovers = RankHandovers()
        handover.collect_descriptions(SimpleNamespace(collective_rpc=lambda method, **_: replies), handovers)
        found = handovers.described()
        assert (found and [info.pid for info in found]) == kept  # in rank order, or none: start-up is refused


def test_ray_v1_is_refused_naming_v2_and_under_pipeline_parallelism_the_lost_replies():
    v2 = object.__new__(MultiprocExecutor)
    version = installed_vllm_version()
    assert handover.refusal(v2, SimpleNamespace(pipeline_parallel_size=1), version, True) is None
    v1 = SimpleNamespace()
    message = handover.refusal(v1, SimpleNamespace(pipeline_parallel_size=1), version, True)
    assert "Ray executor v1" in message and "VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1" in message
    assert "pipeline" not in message
    assert "stage k's reply would never reach the scheduler" in handover.refusal(
        v1, SimpleNamespace(pipeline_parallel_size=2), version, True)


def test_a_vllm_whose_engine_loop_cannot_be_woken_is_refused_naming_the_release_and_what_works():
    from kvelastic.patches import engine_core_wake

    old = Version.parse("0.17.1")
    assert not engine_core_wake.PATCH.claims(old) and engine_core_wake.PATCH.claims(installed_vllm_version())
    message = handover.refusal(object.__new__(MultiprocExecutor), SimpleNamespace(pipeline_parallel_size=1), old,
                               wakeable=False)
    assert "vLLM 0.17.1 cannot wake its engine loop" in message and "0.18 and later" in message
    assert "--distributed-executor-backend uni" in message and "KVELASTIC=0" in message


@pytest.mark.parametrize("backend", ["ray", "mp"])
def test_the_refusals_stop_start_up_before_the_ranks_hear_anything(backend):
    sent: list = []
    version = installed_vllm_version()
    cases = [(object.__new__(MultiprocExecutor), False)]  # an engine loop that cannot be woken
    if backend == "ray":
        cases.append((SimpleNamespace(), True))  # Ray v1
    for executor, wakeable in cases:
        executor.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
            distributed_executor_backend=backend, pipeline_parallel_size=1))
        executor.collective_rpc = lambda *a, **k: sent.append(a)
        handovers = RankHandovers()
        with pytest.raises(PatchError, match="Ray executor v1|cannot wake its engine loop"):
            handover.hand_over(executor, handovers, version, wakeable)
        assert not handovers.was_asked
    assert sent == []


def test_other_executors_pass_straight_through():
    for backend in ("uni", "external_launcher"):
        executor = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
            distributed_executor_backend=backend)), collective_rpc=lambda *a, **k: pytest.fail("a call was sent"))
        handovers = RankHandovers()
        assert handover.hand_over(executor, handovers, installed_vllm_version(), False) is False
        assert not handovers.was_asked
