"""A worker rank on another host than its engine core under Ray (issue #19, rows 5 and 6).

The ranks are the processes of ``test_tp_ray_handover.py``: grandchildren of
this test (a launcher stands for the raylet), driven through vLLM's real
``MultiprocExecutor`` patched by kvelastic. "Another host" is made at the one
place a rank learns where it runs: rank 1's process answers
``engine_folder.host_identity()`` with another host's identity, so the engine
core's hand-over reaches it with a host that is not its own, and its description
names its own host. Shown, with ``KVELASTIC_TP_CONFIRM=step``: that rank is
accepted, writes no file under the shared folder, and the scheduler (which opens
no board or description file at all) hands out blocks only from groups both
ranks reported; a command queued while idle waits for the next step where no
loop can be woken, and rides an empty step where one can; the shared account of
that rank's GPU is not joined on this host. In board mode the rank still refuses.
(vLLM's real engine loop carrying an empty step is ``test_tp_idle_steps.py``'s.)
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.executor.multiproc_executor", reason="needs vllm installed")

from kvelastic.errors import PatchError  # noqa: E402
from kvelastic.patches import engine_folder_handover, executor_step_report  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from kvelastic.tp import board as shm  # noqa: E402
from kvelastic.tp import engine_folder  # noqa: E402
from kvelastic.tp.protocol import RESERVE  # noqa: E402
from kvelastic.tp.rank_files import RankInfo  # noqa: E402
from kvelastic.tp.remote_mapper import STEP  # noqa: E402
from kvelastic.tp.report_merger import step_report_of  # noqa: E402
from kvelastic.tp.scheduler_side import RankConnection, _rank_infos, end_step  # noqa: E402
from tests.scheduler_harness import applied_patch  # noqa: E402
from tests.test_tp_ray_handover import (WORLD, _executor, _runtime, _scheduler_side,  # noqa: E402
                                        map_and_write_on_every_rank, rank_processes)

OTHER_HOST = "0b0b0b0b-0000-4000-8000-000000000001/4026531836"


@pytest.fixture
def shared_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))  # inherited by the launcher and the ranks
    return tmp_path


def _files_under(root: Path) -> set[str]:
    return {path.name for path in root.rglob("*") if path.is_file()}


def _open_no_rank_file(monkeypatch) -> None:
    """From now on this process (the engine core) fails a test that opens any rank's board or description."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"the scheduler opened a rank's file: {args}")

    monkeypatch.setattr(shm.RankBoard, "__init__", refuse)
    monkeypatch.setattr(shm, "read_info", refuse)


def test_a_rank_on_another_host_runs_with_no_folder_and_is_served_on_the_steps_alone(shared_dir, monkeypatch):
    runtime = _runtime(Settings(ray="allow", tp_confirm="step"))
    with rank_processes({1: OTHER_HOST}) as (to_ranks, from_ranks, _), \
            applied_patch(engine_folder_handover, runtime), applied_patch(executor_step_report, None):
        executor = _executor(to_ranks, from_ranks)
        executor.initialize_from_config([])  # patched: the hand-over (rank 1 accepts it), vLLM's calls, descriptions
        folder = shm.engine_dir(os.getpid())
        described = runtime.ray_handovers.described(folder)
        assert described is not None and [i.host for i in described] == [engine_folder.host_identity(), OTHER_HOST]
        assert len(runtime.ray_handovers.ranks_elsewhere(folder)) == 1
        files = _files_under(shared_dir)
        assert {"rank0.board", "rank0.info"} <= files, files  # the rank on this host keeps its folder
        assert not any(name.startswith("rank1") for name in files), f"the rank on another host wrote {files}"
        _open_no_rank_file(monkeypatch)
        connection, pool, queue = _scheduler_side(runtime, wait_s=0.0)
        assert connection.ranks_elsewhere == (1,) and not connection.mapper.idle_through_folder
        map_and_write_on_every_rank(executor, connection, pool, queue)
        _idle_commands_wait_then_ride_an_empty_step(executor, connection, queue, folder)
        assert connection.mapper.boards == []
        assert not any(name.startswith("rank1") for name in _files_under(shared_dir))


def _idle_commands_wait_then_ride_an_empty_step(executor, connection, queue, folder: Path) -> None:
    """A warm-reserve change queued while idle: with no engine loop to wake, it stays queued (no file, no
    board, no wait); once a loop registered, the reclaimer's tick wakes it, the scheduler has work, and the
    empty step's plan carries the command to both ranks, rank 1 included."""
    mapper, idle = connection.mapper, connection.idle_work()
    assert idle is not None and not idle.wake.ready
    connection.cache.pool.grow_reserve(2)  # what the reclaimer asks while idle
    assert mapper.pending_commands == 1
    started = time.monotonic()
    connection.cache.pool.collect()  # the reclaimer's tick, with no loop registered: the fallback
    assert time.monotonic() - started < 1.0, "the fallback waited"
    assert mapper.pending_commands == 1 and not shm.idle_files(folder), "the fallback wrote an idle file"
    assert not idle.waiting()
    posted: list = []
    idle.wake.register(lambda: posted.append("WAKEUP"))  # as patches/engine_core_wake.py registers the loop
    assert idle.waiting(), "the scheduler's has_requests() would not see the waiting command"
    connection.cache.pool.collect()
    assert posted == ["WAKEUP"] and not shm.idle_files(folder)
    output = SimpleNamespace()  # the empty step: schedule() with no request, whose step hook takes the plan
    end_step(SimpleNamespace(cache_config=SimpleNamespace(block_size=16), running=[], waiting=[]), queue, mapper,
             output)
    plan = output.kvelastic_plan
    assert plan.commands[0][1] == RESERVE and not idle.waiting()  # (then maps ahead, as any step may carry)
    executor.execute_model(SimpleNamespace(kvelastic_plan=plan, writes=[]))
    if plan.report:  # this harness's ranks answer a report step on sample_tokens' reply
        connection.reply_hook()(executor.sample_tokens(None))
    asked = dataclasses.replace(mapper.take_plan(), report=True)  # a later step that hears every rank
    assert executor.execute_model(SimpleNamespace(kvelastic_plan=asked, writes=[])) is None
    report = step_report_of(executor.sample_tokens(None))
    assert {r.rank: r.applied >= plan.commands[0][0] for r in report.ranks} == {0: True, 1: True}


def test_in_board_mode_a_rank_on_another_host_still_refuses(shared_dir):
    runtime = _runtime(Settings(ray="allow", tp_confirm="board"))
    with rank_processes({1: OTHER_HOST}) as (to_ranks, from_ranks, _), applied_patch(engine_folder_handover, runtime):
        executor = _executor(to_ranks, from_ranks)
        with pytest.raises(RuntimeError, match="EngineFolderError.*not on the engine core's host.*"
                                               "KVELASTIC_TP_CONFIRM=board.*Set KVELASTIC_TP_CONFIRM=auto"):
            executor.initialize_from_config([])
        assert runtime.ray_handovers.described(shm.engine_dir(os.getpid())) is None


def test_descriptions_missing_from_a_rank_on_another_host_fail_at_once(shared_dir):
    started = time.monotonic()
    with pytest.raises(PatchError, match=r"on other hosts \(pids \[4242\]\) did not all send"):
        _rank_infos(shm.engine_dir(os.getpid()), WORLD, 30.0, None, (4242,))
    assert time.monotonic() - started < 1.0, "the scheduler waited for files a rank on another host never writes"


def _info(rank: int, host: str, gpu_id: str) -> RankInfo:
    from kvelastic.pool.kv_layout import BlockRuns, KVGroupLayout

    layout = KVGroupLayout([BlockRuns(0, 4096, ((0, 8),))], num_blocks=8, page_bytes=8192, blocks_per_group=2)
    return RankInfo(rank=rank, world=2, pid=100 + rank, layout=layout, group_bytes=8192, page_bytes=8192,
                    limit_bytes=None, host_slots=0, slot_bytes=0, gpu_id=gpu_id, host=host)


def test_a_gpu_on_another_host_is_left_out_of_this_hosts_account_of_the_same_name(shared_dir, kv_log):
    """Both ranks name their GPU ``gpu-index0`` (as two hosts' first GPUs without a UUID would): the engine core
    joins this host's account for rank 0 only, charges a group at rank 0's bytes, says so once, and ``kvelastic
    status`` on this host shows one account, one member, one rank's bytes."""
    from kvelastic.cli import read_accounts
    from kvelastic.startup.runtime import Runtime

    here = engine_folder.host_identity()
    connection = RankConnection(shm.engine_dir(os.getpid()), [_info(0, here, "gpu-index0"),
                                                            _info(1, OTHER_HOST, "gpu-index0")],
                                confirm=STEP, here=here)
    runtime = Runtime(Settings(enabled=True, name="far-tp", shared_budget_bytes=64 * 8192))
    scheduler = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="m")))
    link = connection.join_account(scheduler, runtime)
    try:
        assert link is not None
        connection.mapper.request_map([1, 2])  # charged to the account before the ranks hear of it
        shown = read_accounts(None)
        assert [(a["gpu"], [m["name"] for m in a["members"]]) for a in shown] == [("gpu-index0", ["far-tp"])]
        assert shown[0]["charged_bytes"] == 2 * 8192, "the GPU on another host was counted in this host's account"
        # one record (the same record may be captured twice: through kv_log's handler and the root's)
        left_out = list({id(r): r.getMessage() for r in kv_log.records if "left out of sharing" in r.getMessage()}
                        .values())
        assert len(left_out) == 1 and f"gpu-index0 (rank 1, host {OTHER_HOST})" in left_out[0], left_out
    finally:
        link.leave()


def test_board_mode_refuses_descriptions_of_a_rank_on_another_host():
    here = engine_folder.host_identity()
    with pytest.raises(PatchError, match=r"ranks \[1\] run on another host.*KVELASTIC_TP_CONFIRM=step"):
        RankConnection(Path("/nonexistent"), [_info(0, here, "g"), _info(1, OTHER_HOST, "g")], here=here)
