"""A worker rank on another host than its engine core (Ray, or vLLM's multiprocess executor over nodes).

The ranks are the processes of ``test_tp_ray_handover.py``, driven through
vLLM's real ``MultiprocExecutor`` patched by kvelastic. "Another host" is made
at the one place a rank learns where it runs: rank 1's process answers
``rank_handover.host_identity()`` with another host's identity, so its
description names a host that is not the engine core's. Shown: the scheduler
hands out blocks only from groups both ranks reported; a command queued while
idle waits for the next step where no loop can be woken, and rides an empty
step where one can; the shared account of that rank's GPU is not joined on this
host. (vLLM's real engine loop carrying an empty step is ``test_tp_idle_steps.py``'s.)
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.executor.multiproc_executor", reason="needs vllm installed")

from kvelastic.patches import executor_handover, executor_step_report  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from kvelastic.tp import rank_handover  # noqa: E402
from kvelastic.tp.protocol import RESERVE  # noqa: E402
from kvelastic.tp.rank_info import RankInfo  # noqa: E402
from kvelastic.tp.report_merger import step_report_of  # noqa: E402
from kvelastic.tp.scheduler_side import RankConnection, end_step  # noqa: E402
from tests.scheduler_harness import applied_patch  # noqa: E402
from tests.test_tp_ray_handover import (_executor, _files_under, _runtime, _scheduler_side,  # noqa: E402
                                        map_and_write_on_every_rank, rank_processes, shared_dir)  # noqa: F401

OTHER_HOST = "0b0b0b0b-0000-4000-8000-000000000001/4026531836"


def test_a_rank_on_another_host_is_served_on_the_steps_alone(shared_dir, caplog):  # noqa: F811
    runtime = _runtime()
    with rank_processes({1: OTHER_HOST}) as (to_ranks, from_ranks), \
            applied_patch(executor_handover, runtime), applied_patch(executor_step_report, None), \
            caplog.at_level("INFO", logger="vllm.kvelastic"):
        executor = _executor(to_ranks, from_ranks)
        executor.initialize_from_config([])  # patched: the word, vLLM's calls, the descriptions
        described = runtime.rank_handovers.described()
        assert described is not None and [i.host for i in described] == [rank_handover.host_identity(), OTHER_HOST]
        assert "those on other hosts" in caplog.text and "share no GPU account on this host" in caplog.text
        connection, pool, queue = _scheduler_side(runtime)
        assert connection.ranks_elsewhere == (1,)
        map_and_write_on_every_rank(executor, connection, pool, queue)
        _idle_commands_wait_then_ride_an_empty_step(executor, connection, queue)
    assert _files_under(shared_dir) == [], "a rank wrote to the shared folder"


def _idle_commands_wait_then_ride_an_empty_step(executor, connection, queue) -> None:
    """A warm-reserve change queued while idle: with no engine loop to wake, it stays queued (no wait); once a
    loop registered, the reclaimer's tick wakes it, the scheduler has work, and the empty step's plan carries
    the command to both ranks, rank 1 included."""
    mapper, idle = connection.mapper, connection.idle_work()
    assert not idle.wake.ready
    connection.cache.pool.grow_reserve(2)  # what the reclaimer asks while idle
    assert mapper.pending_commands == 1
    started = time.monotonic()
    connection.cache.pool.collect()  # the reclaimer's tick, with no loop registered
    assert time.monotonic() - started < 1.0, "the tick waited"
    assert mapper.pending_commands == 1 and not idle.waiting()
    posted: list = []
    idle.wake.register(lambda: posted.append("WAKEUP"))  # as patches/engine_core_wake.py registers the loop
    assert idle.waiting(), "the scheduler's has_requests() would not see the waiting command"
    connection.cache.pool.collect()
    assert posted == ["WAKEUP"]
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


def _info(rank: int, host: str, gpu_id: str) -> RankInfo:
    from kvelastic.pool.kv_layout import BlockRuns, KVGroupLayout

    layout = KVGroupLayout([BlockRuns(0, 4096, ((0, 8),))], num_blocks=8, page_bytes=8192, blocks_per_group=2)
    return RankInfo(rank=rank, world=2, pid=100 + rank, layout=layout, group_bytes=8192, page_bytes=8192,
                    limit_bytes=None, host_slots=0, slot_bytes=0, gpu_id=gpu_id, host=host)


def test_a_gpu_on_another_host_is_left_out_of_this_hosts_account_of_the_same_name(shared_dir: Path,  # noqa: F811
                                                                                   kv_log):
    """Both ranks name their GPU ``gpu-index0`` (as two hosts' first GPUs without a UUID would): the engine core
    joins this host's account for rank 0 only, charges a group at rank 0's bytes, says so once, and ``kvelastic
    status`` on this host shows one account, one member, one rank's bytes."""
    from kvelastic.cli import read_accounts
    from kvelastic.startup.runtime import Runtime

    here = rank_handover.host_identity()
    connection = RankConnection([_info(0, here, "gpu-index0"), _info(1, OTHER_HOST, "gpu-index0")], here=here)
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
