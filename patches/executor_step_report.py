"""Executor: on a step whose plan asks for a report, gather every rank's reply.

vLLM's multiprocess executor (and Ray's V2 executor, its subclass) asks every rank to
answer a step only when it has an output aggregator; otherwise only the output rank
replies. For the ``execute_model`` of a report step and the ``sample_tokens`` after it,
the executor's aggregator is a :class:`~kvelastic.tp.report_merger.ReportMerger` over
vLLM's own (None without a KV connector), so the ranks' reports reach the scheduler
with the step's output. Every other step is left exactly as vLLM makes it.
"""

from __future__ import annotations

from typing import Any

from kvelastic.patching.carried import Carried
from kvelastic.patching.spec import Attributes, Patch, Signature, Target
from kvelastic.patches._common import ALL

_MP = "vllm.v1.executor.multiproc_executor"

EXECUTOR = Target(  # set on one call's executor for that call only, vLLM's own put back after it
    module="vllm.v1.executor.abstract",
    qualname="Executor",
    kind="class",
    use="instance",
    shapes=(Attributes(ALL, ("kv_output_aggregator",)),),
)
EXECUTE = Target(
    module=_MP,
    qualname="MultiprocExecutor.execute_model",
    kind="method",
    shapes=(Signature(ALL, ("self", "scheduler_output", "non_block")),),
)
SAMPLE = Target(
    module=_MP,
    qualname="MultiprocExecutor.sample_tokens",
    kind="method",
    shapes=(Signature(ALL, ("self", "grammar_output", "non_block")),),
)
MODEL_RUNNER_OUTPUT = Target(  # carries a rank's report back, and the merged reports to the scheduler
    module="vllm.v1.outputs",
    qualname="ModelRunnerOutput",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ()),),
)
#: One rank's ``RankReport``, on (a copy of) its reply to a report step.
RANK_REPORT = Carried("kvelastic_rank_report", MODEL_RUNNER_OUTPUT)
#: Every rank's reports as one ``StepReport``, on the output that reaches the scheduler.
STEP_REPORT = Carried("kvelastic_report", MODEL_RUNNER_OUTPUT)
TARGETS = (EXECUTOR, EXECUTE, SAMPLE, MODEL_RUNNER_OUTPUT)


def apply(patcher: Any, runtime: Any) -> None:
    from kvelastic.tp.report_merger import ReportRouting

    routing = ReportRouting()
    patcher.wrap(EXECUTE, routing.execute)
    patcher.wrap(SAMPLE, routing.sample)


PATCH = Patch("executor_step_report", "Executor: every rank's reply on the steps that carry rank reports",
              ALL, TARGETS, apply)
