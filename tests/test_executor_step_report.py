"""vLLM's real multiprocess executor, patched by ``executor_step_report``, gathering the ranks' reports.

Only the message queues between the executor and its worker processes are stood in
for (the true boundary: shared memory to other processes). ``collective_rpc``, its
futures and their order, and vLLM's own connector aggregator are vLLM's. What is
checked: a report step makes every rank answer both of its calls; the reports the
ranks sent in place of ``execute_model``'s ``None`` reach the scheduler on the output
of ``sample_tokens``; every other step asks only the output rank, as vLLM does; the
executor's aggregator is vLLM's own again after each call.
"""

from __future__ import annotations

import pickle
from collections import deque
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.executor.multiproc_executor", reason="needs vllm installed")

from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from kvelastic.patches import executor_step_report  # noqa: E402
from kvelastic.tp.protocol import StepPlan  # noqa: E402
from kvelastic.tp.report_merger import reply_with_report, step_report_of  # noqa: E402
from kvelastic.tp.step_report import CommandTally, RankReport  # noqa: E402
from tests.scheduler_harness import applied_patch  # noqa: E402

WORLD = 2


class Broadcast:
    """The executor's broadcast queue to every rank: records each call as sent."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def enqueue(self, item: tuple) -> None:
        self.sent.append(item)


class RankReplies:
    """One rank's response queue: answers each read with the next scripted reply, pickled as on the wire."""

    def __init__(self) -> None:
        self.replies: deque = deque()
        self.reads = 0

    def dequeue(self, timeout=None, **_):
        self.reads += 1
        return WorkerProc.ResponseStatus.SUCCESS, pickle.loads(pickle.dumps(self.replies.popleft()))


@pytest.fixture
def executor():
    with applied_patch(executor_step_report, None):
        ex = object.__new__(MultiprocExecutor)  # no worker processes: the queues below stand for them
        ex.rpc_broadcast_mq, ex.response_mqs = Broadcast(), [RankReplies() for _ in range(WORLD)]
        ex.futures_queue, ex.is_failed, ex.output_rank = deque(), False, 0
        ex.kv_output_aggregator = ex.ec_output_aggregator = None
        ex.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(enable_fault_tolerance=False))
        yield ex
    assert "kvelastic" not in repr(MultiprocExecutor.execute_model), "the class wrap outlived revert()"


def _output() -> ModelRunnerOutput:
    return ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(finished_sending={"req"}))


def _step(report: bool, step: int = 1) -> SimpleNamespace:
    return SimpleNamespace(kvelastic_plan=StepPlan(step=step, report=report))


def _rank_report(rank: int, seq: int, done: int) -> RankReport:
    return RankReport(rank=rank, applied=seq, step=1, maps=((seq, done),))


@pytest.mark.parametrize("non_block", [False, True])
def test_a_report_step_hears_every_rank_and_its_reports_reach_the_sample_tokens_output(executor, non_block):
    for rank, queue in enumerate(executor.response_mqs):
        queue.replies.append(reply_with_report(None, _rank_report(rank, seq=7, done=3 - rank)))
        queue.replies.append(_output())
    launched = executor.execute_model(_step(report=True), non_block=non_block)
    sampled = executor.sample_tokens(None, non_block=non_block)
    if non_block:  # the engine reads the later future first: vLLM resolves the earlier one on the way
        sampled, launched = sampled.result(), launched.result()
    assert launched is None, "execute_model must still mean 'forward launched' to the engine"
    assert [sent[3] for sent in executor.rpc_broadcast_mq.sent] == [None, None], "every rank must answer"
    assert [q.reads for q in executor.response_mqs] == [2, 2]
    report = step_report_of(sampled)
    assert report is not None and CommandTally(WORLD).add(report) == {7: 2}
    assert sampled.kv_connector_output.finished_sending == {"req"}
    assert executor.kv_output_aggregator is None, "vLLM's aggregator (none here) must be back after the call"


def test_other_steps_ask_only_the_output_rank_as_vllm_does(executor):
    executor.response_mqs[0].replies.extend([None, _output()])
    assert executor.execute_model(_step(report=False)) is None
    assert step_report_of(executor.sample_tokens(None)) is None
    executor.response_mqs[0].replies.append(_output())
    executor.execute_model(SimpleNamespace())  # a step with no plan at all (no ranks to drive)
    assert [sent[3] for sent in executor.rpc_broadcast_mq.sent] == [0, 0, 0]
    assert [q.reads for q in executor.response_mqs] == [3, 0]


def test_a_step_that_returns_its_output_from_execute_model_carries_the_reports_there(executor):
    for rank, queue in enumerate(executor.response_mqs):
        queue.replies.append(reply_with_report(EMPTY_MODEL_RUNNER_OUTPUT, _rank_report(rank, seq=4, done=2)))
        queue.replies.append(None)  # the next step's execute_model, asked of the output rank only
    out = executor.execute_model(_step(report=True))
    assert CommandTally(WORLD).add(step_report_of(out)) == {4: 2}
    assert step_report_of(EMPTY_MODEL_RUNNER_OUTPUT) is None, "vLLM's shared empty output was changed"
    executor.execute_model(_step(report=False, step=2))  # no sample_tokens came: its merger is dropped
    assert executor.rpc_broadcast_mq.sent[-1][3] == 0


def test_vllm_s_connector_aggregator_still_merges_its_own_outputs_on_report_steps(executor):
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    own = KVOutputAggregator(WORLD)
    executor.kv_output_aggregator = own
    for rank, queue in enumerate(executor.response_mqs):
        queue.replies.append(reply_with_report(None, _rank_report(rank, seq=2, done=1)))
        queue.replies.append(_output())
    assert executor.execute_model(_step(report=True)) is None
    sampled = executor.sample_tokens(None)
    assert executor.kv_output_aggregator is own
    assert CommandTally(WORLD).add(step_report_of(sampled)) == {2: 1}
    # both ranks finished sending "req": vLLM's aggregator reports it once all ranks did
    assert sampled.kv_connector_output.finished_sending == {"req"}
