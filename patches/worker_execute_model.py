"""Worker: apply the scheduler's page-group and copy commands around each step's forward pass.

Only on worker ranks whose scheduler is another process (tensor parallelism,
multiprocess executor); elsewhere the wrapper passes straight through. Unmaps,
copies and fences run before the forward; the step's maps run once
``execute_model`` returns, which vLLM's worker does as soon as the forward is
launched (and, on a pipeline stage that is not the last, sent on): the GPU
computes while the driver calls run. Nothing
more is asked of vLLM: were the call to return only once the GPU is done, the
maps would still be exact, only no longer hidden. On a step whose plan asks for
a report, the rank's reply carries what it mapped, maps of this step included
(``patches/executor_step_report.py`` makes the executor gather every rank's reply).
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.carried import Carried
from kvelastic.patching.spec import Attributes, Patch, Signature, Target
from kvelastic.patches._common import ALL

TARGET = Target(
    module="vllm.v1.worker.gpu_worker",
    qualname="Worker.execute_model",
    kind="method",
    shapes=(Signature(ALL, ("self", "scheduler_output")),),
)
SCHEDULER_OUTPUT = Target(  # carries the step's commands to every rank (vLLM broadcasts it)
    module="vllm.v1.core.sched.output",
    qualname="SchedulerOutput",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ()),),
)
#: The commands of a step (a ``StepPlan``), put on its output by the scheduler's step hook.
PLAN = Carried("kvelastic_plan", SCHEDULER_OUTPUT)


def _execute(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    worker = runtime.rank_worker
    if worker is None:
        return wrapped(*args, **kwargs)
    scheduler_output = args[0] if args else kwargs.get("scheduler_output")
    plan = PLAN.get(scheduler_output)
    if plan is None:
        return wrapped(*args, **kwargs)
    worker.before_step(plan)
    result = wrapped(*args, **kwargs)  # the forward is launched (sync or async scheduling alike)
    worker.after_step(plan)  # the step's maps, then its confirmations
    if plan.report:  # the executor gathers every rank's reply to this step
        from kvelastic.tp.report_merger import reply_with_report

        return reply_with_report(result, worker.take_report())
    return result


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, functools.partial(_execute, runtime))


PATCH = Patch("worker_execute_model", "Worker: apply the scheduler's KV page commands around the forward pass",
              ALL, (TARGET, SCHEDULER_OUTPUT), apply)
