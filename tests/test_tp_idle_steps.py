"""Idle delivery by an empty step, with vLLM's real Scheduler and engine loop.

Two rank processes serve vLLM's real scheduler (as in ``test_tp_real_scheduler.py``).
The engine loop is vLLM's own ``EngineCoreProc.run_busy_loop``, wrapped by
``patches/engine_core_wake.py``, and its real ``_process_input_queue``, which
blocks on the input queue while ``has_work()`` is false; only the step itself
(schedule, both ranks' ``execute_model``, ``update_from_output``) is the harness's.
The reclaimer is kvelastic's real thread: once the engine idles it gives back
the cached groups and wakes the loop, and the unmap must reach both ranks on a
step with no tokens.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

import pytest

pytest.importorskip("vllm.v1.engine.core", reason="needs vllm installed")

from kvelastic.patches import engine_core_wake  # noqa: E402
from kvelastic.tp.idle_steps import IdleSteps  # noqa: E402
from kvelastic.tp.protocol import UNMAP  # noqa: E402
from kvelastic.patches.executor_step_report import STEP_REPORT  # noqa: E402
from tests.scheduler_harness import applied_patch, make_requests, model_output  # noqa: E402
from tests.test_tp_real_scheduler import _forward, drive_ranks, tp_engine  # noqa: E402,F401,F811
from tests.tp_cluster import wait_for  # noqa: E402

CACHE_TTL_S = 0.3  # the reclaimer gives back cached groups idle this long (once no allocation for 1 s)
WAIT_S = 20.0


def _engine_class():
    """vLLM's ``EngineCoreProc`` with its real loop, made without an engine: only the step is the harness's."""
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    class LoopOverRanks(EngineCoreProc):
        def __init__(self, scheduler, ranks):  # noqa: D107 - vLLM's __init__ starts an engine; these suffice
            self.scheduler, self.ranks = scheduler, ranks
            self.input_queue: queue.Queue = queue.Queue()
            self.aborts_queue: queue.Queue = queue.Queue()
            self.engines_running, self.batch_queue, self.process_input_queue_block = False, None, True
            self._idle_state_callbacks: list = []
            self.shutdown_state = EngineShutdownState.RUNNING
            self.publish_dp_lb_stats, self.enable_fault_tolerance = False, False
            self.stopping = False
            self._deferred_inputs: collections.deque = collections.deque()  # read by the loop from 0.34
            self.steps: list = []  # (tokens scheduled, plan) of every step the loop ran

        def _handle_shutdown(self) -> bool:
            return not self.stopping

        def is_running(self) -> bool:
            return not self.stopping

        def _process_engine_step(self) -> bool:
            if not self.scheduler.has_requests():  # as vLLM's step() begins
                return False
            out = self.scheduler.schedule()
            self.ranks.send(out.kvelastic_plan, *_forward(self.scheduler, out))
            result = model_output(self.scheduler, out, set())
            report = self.ranks.merged_report(out.kvelastic_plan)  # every rank's reply, as vLLM's executor merges
            if report is not None:
                STEP_REPORT.put(result, report)
            self.scheduler.update_from_output(out, result)
            self.steps.append((out.total_num_scheduled_tokens, out.kvelastic_plan))
            return out.total_num_scheduled_tokens > 0

        def stop(self) -> None:
            self.stopping = True
            self.input_queue.put_nowait(("stop", None))  # any request ends the blocking get; then the loop ends

        def _handle_client_request(self, request_type, request) -> None:
            if request_type != "stop":
                super()._handle_client_request(request_type, request)

    return LoopOverRanks


class RunningLoop:
    """The loop on its own thread (as the engine core's main thread runs it), stopped on leaving."""

    def __init__(self, scheduler, ranks):
        self.engine = _engine_class()(scheduler, ranks)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.engine.run_busy_loop()
        except SystemExit:
            pass  # how vLLM's loop ends
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def __enter__(self) -> "RunningLoop":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the engine loop did not stop"


def _wait_for(condition) -> bool:
    return wait_for(condition, WAIT_S)


def _unmapped(plan) -> set[int]:
    return {g for command in plan.commands if command[1] == UNMAP for g in command[2]}


def _wave(tag: str) -> list:
    return make_requests(tag, 4, 320, 160, seed=0, max_tokens=4)


def test_an_unmap_queued_while_idle_rides_an_empty_step_to_both_ranks(tp_engine):
    with applied_patch(engine_core_wake, None):
        scheduler, ranks = tp_engine(cache_ttl_s=CACHE_TTL_S)
        queue_ = scheduler.kv_cache_manager.block_pool.free_block_queue
        mapper = queue_.mapper
        assert queue_.cache.pool.idle_steps is not None
        drive_ranks(scheduler, ranks, [_wave("a")])  # no loop yet: vLLM's steps, as in the harness
        busy = list(ranks.mapped_bytes)
        cached = set(mapper.mapped_groups)
        wake = queue_.cache.pool.idle_steps.wake
        assert getattr(scheduler, engine_core_wake.WAKE_ATTRIBUTE) is wake and not wake.ready
        with RunningLoop(scheduler, ranks) as loop:
            assert _wait_for(lambda: wake.ready or loop.error), "the wrapped run_busy_loop registered no wake-up"
            assert loop.error is None and wake.ready, f"the loop failed: {loop.error!r}"
            assert _wait_for(lambda: any(_unmapped(plan) for _, plan in loop.engine.steps)), \
                f"no empty step carried the idle unmap (loop error: {loop.error!r})"
            assert _wait_for(lambda: not scheduler.has_requests()), "commands kept the engine stepping"
            steps = list(loop.engine.steps)
        assert not wake.ready, "the wake-up outlived its loop"
    assert loop.error is None, loop.error
    assert steps and all(tokens == 0 for tokens, _ in steps), "the loop ran a step with tokens while idle"
    given_back = set().union(*(_unmapped(plan) for _, plan in steps))
    assert given_back & cached, "the empty steps did not give back the groups the wave left cached"
    assert ranks.mapped_bytes[0] == ranks.mapped_bytes[1] < busy[0], "the ranks kept the unmapped pages"
    assert queue_.cache.pool.idle_steps.steps_asked >= 1
    # later commands come after them on both ranks: the same groups mapped again, every block's data checked
    last_idle = max(c[0] for _, plan in steps for c in plan.commands)
    reports: list = []
    seen: set = set()
    drive_ranks(scheduler, ranks, [_wave("b")], reports, seen)
    later = [c for report in reports for rank in report.ranks for c in rank.maps]
    assert later and min(seq for seq, _ in later) > last_idle, "a later map was numbered before the idle unmap"
    assert seen & given_back, "no group given back while idle was mapped again by the next wave"
    assert ranks.mapped_bytes[0] == ranks.mapped_bytes[1] > 0


def test_where_no_loop_can_be_woken_the_commands_wait_for_the_next_step_and_it_is_said_once(caplog):
    """An in-process engine core, or DP over MoE (vLLM's own ``DPEngineCoreProc`` loop): nothing registers, so
    the reclaimer's tick sends nothing and the commands stay queued for the engine's next step; once the engine
    has stepped (its loop would have registered by then), the log says so, once."""
    pending, stepped = [3], [False]
    idle = IdleSteps(lambda: pending[0], stepped=lambda: stepped[0])
    with caplog.at_level(logging.WARNING, logger="vllm.kvelastic"):
        assert not idle.deliver() and not idle.waiting()  # the engine's start-up: no loop yet, nothing said
        assert "cannot be woken" not in caplog.text
        stepped[0] = True
        assert not idle.deliver() and not idle.deliver()
    assert caplog.text.count("this engine's loop cannot be woken") == 1, caplog.text
    assert idle.steps_asked == 0 and pending == [3]
    posted: list = []
    idle.wake.register(lambda: posted.append("WAKEUP"))  # a loop that can be woken
    assert idle.waiting() and idle.deliver() and posted == ["WAKEUP"]
    pending[0] = 0
    assert not idle.waiting() and not idle.deliver() and posted == ["WAKEUP"]
