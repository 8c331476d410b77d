"""Under Ray a rank is not its engine core's child: the engine's folder reaches it over vLLM's collective_rpc.

The engine core is this test process. A launcher process starts the ranks and
stays their parent, as the raylet is a Ray actor's, so ``os.getppid()`` names
the wrong engine. vLLM's real ``MultiprocExecutor`` (the base of Ray's V2
executor) drives them, patched by ``engine_folder_handover``: only its message
queues are stood in for, by pipes to the ranks, which run each call the way
vLLM's ``WorkerProc`` does (``run_method`` for a pickled callable). Checked: a
rank finds its engine's folder through the hand-over (the scheduler reads its
description there), fails with a clear error without it, refuses an engine
core on another host; the multiprocess path is left as it was; the refusals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
from collections import deque
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.executor.multiproc_executor", reason="needs vllm installed")

from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc  # noqa: E402

from kvelastic.errors import EngineFolderError, PatchError  # noqa: E402
from kvelastic.patches import engine_folder_handover, executor_step_report  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from kvelastic.tp import board as shm  # noqa: E402
from kvelastic.tp import engine_folder, ray_executor  # noqa: E402
from kvelastic.tp.protocol import MAP, START_SEQ, UNMAP  # noqa: E402
from kvelastic.tp.rank_files import RankInfo, encode_info  # noqa: E402
from kvelastic.tp.ray_executor import hand_over_folder, ray_refusal  # noqa: E402
from kvelastic.tp.remote_mapper import STEP  # noqa: E402
from kvelastic.tp.report_merger import step_report_of  # noqa: E402
from kvelastic.tp.step_report import CommandTally  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP  # noqa: E402
from tests.scheduler_harness import applied_patch  # noqa: E402

WORLD = 2
TIMEOUT_S = 120
#: The groups each rank maps before it serves (the null group 0 aside): group 1 on both, group 2 on rank 0 only.
START_GROUPS = ((1, 2), (1,))


# ------------------------------------------------------------------ the ranks (other processes)
class _Worker:
    """What a rank's vLLM worker does with the executor's calls: initialise its KV cache (find its engine's
    folder, as ``serve_as_rank`` does, and describe itself there), then run each step through the
    ``Worker.execute_model`` wrap, whose forward pass writes the step's blocks (each must be mapped)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.runtime = SimpleNamespace(rank_worker=None)
        self.pool = self.views = self.cache = None

    def initialize_from_config(self, *_) -> None:
        from kvelastic.tp.worker_side import start_rank
        from tests.kv_fixtures import build_cache

        found = engine_folder.rank_folder("ray")
        self.pool, self.views, self.cache = build_cache()
        self.cache.map_groups(START_GROUPS[self.rank])  # as vLLM's start-up may, before the scheduler exists
        self.runtime.rank_worker = start_rank(self.cache, found.folder, self.rank, WORLD, None, None)

    def compile_or_warm_up_model(self) -> SimpleNamespace:
        return SimpleNamespace(language_model=0.0, encoder=0.0)

    def execute_model(self, scheduler_output) -> object:
        from patches.worker_execute_model import _execute

        def forward(_scheduler_output) -> None:  # "launched": the step's writes, on this rank's shard
            for block_id in scheduler_output.writes:
                assert self.pool.is_mapped(self.cache.group_of_block(block_id)), f"write to unmapped {block_id}"
                for view in self.views:
                    view[:, block_id].fill_(self.rank + 1)

        return _execute(self.runtime, forward, self, (scheduler_output,), {})

    def sample_tokens(self, _grammar_output) -> SimpleNamespace:
        return SimpleNamespace(rank=self.rank)  # the step's output (only the output rank's reaches the engine)

    def close(self) -> None:
        if self.runtime.rank_worker is not None:
            self.runtime.rank_worker.close()
            self.pool.close()


def _rank_main(rank: int, inbox, outbox, host: str | None = None) -> None:
    """Answer the executor's calls as vLLM's WorkerProc does: ``run_method`` on the worker, then success and
    result, or failure and the error, sent only by the rank the call asks to reply (every rank if none).
    ``host``: the host identity this rank reads for its own (another host's, for the tests of one), at the one
    place a rank learns where it runs."""
    from vllm.v1.serial_utils import run_method

    if host is not None:
        engine_folder.host_identity = lambda: host
    worker = _Worker(rank)
    while True:
        item = inbox.recv()
        if item is None:
            worker.close()
            return
        method, args, kwargs, reply_rank = item
        try:
            answer = (WorkerProc.ResponseStatus.SUCCESS, run_method(worker, method, args, kwargs))
        except Exception as error:  # noqa: BLE001 - sent back, as vLLM's worker does
            answer = (WorkerProc.ResponseStatus.FAILURE, f"{type(error).__name__}: {error}")
        if reply_rank is None or reply_rank == rank:
            outbox.send(answer)


def _launcher(pipes, hosts: dict) -> None:
    """The ranks' parent, standing for the raylet: not the engine core. ``hosts``: rank -> another host."""
    ranks = [multiprocessing.get_context("spawn").Process(target=_rank_main, args=(r, *pipes[r], hosts.get(r)))
             for r in range(WORLD)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()


# ------------------------------------------------------------------ the engine core (this process)
class Broadcast:
    def __init__(self, pipes) -> None:
        self.pipes = pipes

    def enqueue(self, item: tuple) -> None:
        for pipe in self.pipes:
            pipe.send(item)


class Replies:
    def __init__(self, pipe) -> None:
        self.pipe = pipe

    def dequeue(self, timeout=None, **_):
        if not self.pipe.poll(TIMEOUT_S if timeout is None else timeout):
            raise TimeoutError("no reply from the rank")
        return self.pipe.recv()


def _executor(to_ranks, from_ranks, backend: str = "ray", stages: int = 1) -> MultiprocExecutor:
    ex = object.__new__(MultiprocExecutor)  # no worker processes of vLLM's: the pipes stand for its queues
    ex.rpc_broadcast_mq, ex.response_mqs = Broadcast(to_ranks), [Replies(p) for p in from_ranks]
    ex.futures_queue, ex.is_failed, ex.output_rank = deque(), False, 0
    ex.kv_output_aggregator = ex.ec_output_aggregator = None
    parallel = SimpleNamespace(distributed_executor_backend=backend, pipeline_parallel_size=stages,
                               enable_fault_tolerance=False)
    ex.vllm_config = SimpleNamespace(parallel_config=parallel, compilation_config=SimpleNamespace())
    return ex


def _runtime(settings: Settings) -> SimpleNamespace:
    """What the patches and the scheduler side read of the engine core's Runtime: its settings and the
    record of what the executor handed to Ray's ranks."""
    from kvelastic.tp.handovers import RayHandovers

    return SimpleNamespace(settings=settings, ray_handovers=RayHandovers())


def _scheduler_side(runtime: SimpleNamespace, wait_s: float = TIMEOUT_S):
    """The engine core's scheduler side as ``attach_scheduler`` connects it (``connect_ranks``, which waits
    ``wait_s`` for description files), in front of vLLM's BlockPool made page-aware: (connection, block
    pool, queue)."""
    from vllm.v1.core.block_pool import BlockPool

    from kvelastic.hooks.block_pool import make_page_aware
    from kvelastic.tp.scheduler_side import connect_ranks
    from tests.kv_fixtures import BS, N
    from tests.scheduler_harness import scheduler_patcher

    parallel = SimpleNamespace(world_size=WORLD, pipeline_parallel_size=1, distributed_executor_backend="ray")
    connection = connect_ranks(SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel)),
                               runtime, contextlib.nullcontext(), wait_s=wait_s)
    pool = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
    queue = make_page_aware(pool, connection.cache, connection.mapper, patcher=scheduler_patcher(),
                            max_ahead_groups=2)
    return connection, pool, queue


@pytest.fixture
def ranks(tmp_path, monkeypatch):
    """WORLD rank processes, grandchildren of this one, and vLLM's executor wired to them."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))  # inherited by the launcher and the ranks
    with rank_processes({}) as found:
        yield found


@contextlib.contextmanager
def rank_processes(hosts: dict):
    """WORLD rank processes under a launcher: (pipes to them, pipes from them, the launcher's pid).
    ``hosts``: rank -> the host identity it finds for itself (absent: this host's)."""
    context = multiprocessing.get_context("spawn")
    inboxes = [context.Pipe() for _ in range(WORLD)]
    outboxes = [context.Pipe() for _ in range(WORLD)]
    pipes = [(inboxes[r][1], outboxes[r][0]) for r in range(WORLD)]
    launcher = context.Process(target=_launcher, args=(pipes, hosts))
    launcher.start()
    to_ranks, from_ranks = [i[0] for i in inboxes], [o[1] for o in outboxes]
    try:
        yield to_ranks, from_ranks, launcher.pid
    finally:
        for pipe in to_ranks:
            pipe.send(None)
        launcher.join(TIMEOUT_S)
        if launcher.is_alive():
            launcher.kill()


@pytest.fixture
def patched():
    """The hand-over patch applied for a Runtime with KVELASTIC_RAY=allow; yields that runtime."""
    runtime = _runtime(Settings(ray="allow"))
    with applied_patch(engine_folder_handover, runtime):
        yield runtime


def test_ranks_that_are_not_the_engines_children_find_its_folder_through_the_hand_over(ranks, patched):
    to_ranks, from_ranks, launcher_pid = ranks
    executor = _executor(to_ranks, from_ranks)
    executor.initialize_from_config([])  # patched: the hand-over, then vLLM's own calls to the ranks
    folder = shm.engine_dir(os.getpid())
    infos = [shm.read_info(folder, r) for r in range(WORLD)]  # where the scheduler looks without a hand-over
    assert all(info is not None for info in infos), "the ranks did not describe themselves in the engine's folder"
    assert {info.pid for info in infos}.isdisjoint({os.getpid(), launcher_pid})
    sent = patched.ray_handovers.described(folder)  # and what they sent back over collective_rpc, read first
    assert sent is not None and [encode_info(i) for i in sent] == [encode_info(i) for i in infos]


def test_step_confirmations_come_back_on_the_replies_of_ranks_that_are_not_the_engines_children(ranks):
    """KVELASTIC_TP_CONFIRM=step under Ray's V2 executor: a report step makes vLLM's executor hear every rank,
    the ranks' reports reach the scheduler on the step's output, and a group's blocks are handed out only
    once both ranks' word on it was adopted from there. The scheduler connects with neither description
    files nor boards: the start-up state comes in the descriptions sent back over collective_rpc (the group
    both ranks mapped adopted, the one only rank 0 mapped unmapped with the first step)."""
    from tests.test_tp_step_report import remove_boards

    to_ranks, from_ranks, _ = ranks
    runtime = _runtime(Settings(ray="allow", tp_confirm="step"))
    with applied_patch(engine_folder_handover, runtime), \
            applied_patch(executor_step_report, None):
        with pytest.raises(PatchError, match="KVELASTIC_TP_CONFIRM=step .* without that hand-over"):
            _scheduler_side(runtime)  # no folder handed over yet: the executor could be anything
        executor = _executor(to_ranks, from_ranks)
        executor.initialize_from_config([])  # patched: the hand-over, vLLM's own calls, the descriptions
        folder = shm.engine_dir(os.getpid())
        for rank in range(WORLD):  # the scheduler must take the descriptions from the ranks' replies
            (folder / f"rank{rank}.info").unlink()
        remove_boards(folder)  # ... and the start-up state too
        connection, pool, queue = _scheduler_side(runtime, wait_s=0.0)
        map_and_write_on_every_rank(executor, connection, pool, queue)


def map_and_write_on_every_rank(executor, connection, pool, queue) -> list:
    """From a connection made in step mode with no board: the start-up state adopted from the descriptions,
    a report step hearing every rank, blocks handed out only from the groups every rank reported, each rank's
    writes landing in mapped groups, and both ranks then holding the same bytes."""
    mapper, adopt = connection.mapper, connection.reply_hook()
    assert mapper.confirm == STEP and adopt is not None and mapper.boards == []
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


def test_without_the_hand_over_a_ray_rank_fails_with_a_clear_error(ranks):
    to_ranks, from_ranks, launcher_pid = ranks
    executor = _executor(to_ranks, from_ranks)
    with pytest.raises(RuntimeError, match="EngineFolderError.*handed no engine folder") as caught:
        executor.collective_rpc("initialize_from_config")  # vLLM's call, no kvelastic wrap in front
    assert f"its parent (pid {launcher_pid}) is not its engine core" in str(caught.value)
    assert "KVELASTIC_RAY=allow" in str(caught.value)
    assert shm.read_info(shm.engine_dir(os.getpid()), 0) is None


def test_the_multiprocess_path_hands_nothing_over_and_names_the_parent(patched):
    executor = object.__new__(MultiprocExecutor)
    executor.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="mp"),
                                           compilation_config=SimpleNamespace())
    calls: list = []
    executor.collective_rpc = lambda method, *a, **k: calls.append(method) or []
    executor.initialize_from_config([])  # patched: vLLM's own calls only
    assert calls and all(isinstance(method, str) for method in calls)
    here = engine_folder.rank_folder("mp")  # a multiprocess rank: its parent is its engine core
    assert here.engine_pid == os.getppid() and here.folder == shm.engine_dir(os.getppid())


def test_descriptions_sent_back_are_kept_only_when_each_rank_sent_its_own(tmp_path, monkeypatch):
    from kvelastic.pool.kv_layout import BlockRuns, KVGroupLayout

    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    folder = shm.engine_dir(os.getpid())
    layout = KVGroupLayout([BlockRuns(0, 4096, ((0, 8),))], num_blocks=8, page_bytes=8192, blocks_per_group=2)

    def sent(rank: int) -> bytes:
        return encode_info(RankInfo(rank=rank, world=WORLD, pid=100 + rank, layout=layout, group_bytes=8192,
                                    page_bytes=8192, limit_bytes=None, host_slots=0, slot_bytes=0))

    for replies, kept in (([sent(1), sent(0)], [100, 101]), ([sent(0), None], None), ([sent(1), sent(1)], None)):
        handovers = _runtime(Settings()).ray_handovers
        ray_executor.collect_descriptions(SimpleNamespace(collective_rpc=lambda method, **_: replies), folder,
                                          handovers)
        found = handovers.described(folder)
        assert (found and [info.pid for info in found]) == kept  # in rank order, or none: the files decide


def test_a_rank_on_another_host_refuses_the_hand_over(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    folder = str(shm.engine_dir(os.getpid()))
    with pytest.raises(EngineFolderError, match="not on the engine core's host.*Set KVELASTIC_TP_CONFIRM=auto"):
        engine_folder.receive(None, folder, os.getpid(), "another-boot-id/4026531836")
    with pytest.raises(EngineFolderError, match="not on the engine core's host"):
        engine_folder.receive(None, folder, os.getpid(), "another-boot-id/4026531836", "board")
    try:  # confirmed on the steps' replies, the rank runs with no folder (not even this one's, or a wrong one)
        assert engine_folder.receive(None, "/elsewhere/engine-1-2-3", 1, "another-boot-id/1", "step") == \
            (os.getpid(), engine_folder.host_identity())
        assert engine_folder.rank_folder("ray").folder is None
    finally:
        engine_folder.forget()
    with pytest.raises(EngineFolderError, match="same KVELASTIC_SHARED_DIR"):
        engine_folder.receive(None, "/elsewhere/engine-1-2-3", os.getpid(), engine_folder.host_identity())
    try:
        assert engine_folder.receive(None, folder, os.getpid(), engine_folder.host_identity()) == \
            (os.getpid(), engine_folder.host_identity())
        assert engine_folder.rank_folder("ray").folder == shm.engine_dir(os.getpid())
    finally:
        engine_folder.forget()


def test_ray_v2_is_allowed_by_default_refused_on_request_and_ray_v1_always():
    parallel = SimpleNamespace(pipeline_parallel_size=1)
    v2 = object.__new__(MultiprocExecutor)
    assert ray_refusal(Settings().ray, v2, parallel) is None
    assert "KVELASTIC_RAY=refuse" in ray_refusal("refuse", v2, parallel)
    v1 = SimpleNamespace()
    message = ray_refusal("allow", v1, parallel)
    assert "Ray executor v1" in message and "VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1" in message
    assert "pipeline" not in message
    assert "stage k's reply would never reach the scheduler" in ray_refusal("allow", v1,
                                                                           SimpleNamespace(pipeline_parallel_size=2))


def test_the_refusal_stops_start_up_before_the_ranks_hear_anything():
    sent: list = []
    for setting, executor in (("refuse", object.__new__(MultiprocExecutor)), ("allow", SimpleNamespace())):
        executor.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
            distributed_executor_backend="ray", pipeline_parallel_size=1))
        executor.collective_rpc = lambda *a, **k: sent.append(a)
        with pytest.raises(PatchError, match="Ray executor"):
            hand_over_folder(executor, setting, _runtime(Settings()).ray_handovers)
    assert sent == []


def test_the_setting_is_allow_unless_refused():
    assert Settings().ray == "allow"
    assert Settings.from_env({"KVELASTIC_RAY": "Refuse"}).ray == "refuse"
    with pytest.raises(Exception, match="KVELASTIC_RAY='yes' is not one of: allow, refuse"):
        Settings.from_env({"KVELASTIC_RAY": "yes"})
