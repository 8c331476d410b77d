"""Carry rank reports on vLLM's step replies, and merge them where vLLM merges KV-connector outputs.

vLLM's multiprocess executors (Ray V2 included) take every rank's reply to a step only when
an output aggregator is passed to ``collective_rpc``; otherwise only the output rank
answers. On the steps whose plan asks for a report, :class:`ReportRouting` hands the
executor a :class:`ReportMerger` for that step's two calls (``execute_model``, then
``sample_tokens``). Each rank answers ``execute_model`` with its report (in place of the
``None`` that means "forward launched", or on a copy of the output it returned), so a
report never waits for an asynchronous output to resolve. The merger pulls the reports
out, lets vLLM's own aggregator (the user's KV connector's, if any) merge the rest, and
puts the ranks' reports together on the output that reaches the scheduler. The merger is
duck-typed (vLLM calls ``aggregate(outputs, output_rank=...)``; other calls go to vLLM's
aggregator), so nothing of vLLM is imported here.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Sequence

from kvelastic.patches.executor_step_report import RANK_REPORT, STEP_REPORT
from kvelastic.patches.worker_execute_model import PLAN
from kvelastic.tp.step_report import RankReport, StepReport


def attach_rank_report(output: Any, report: RankReport) -> Any:
    """``output`` (a ModelRunnerOutput) with ``report`` on it: a shallow copy, since vLLM
    shares one empty output object among all steps that have nothing to say."""
    carrier = copy.copy(output)
    RANK_REPORT.put(carrier, report)
    return carrier


def reply_with_report(output: Any, report: RankReport) -> Any:
    """A rank's reply to a report step's ``execute_model``: the report itself where the
    rank returned ``None`` (the merger gives vLLM its ``None`` back), else the output carrying it."""
    return report if output is None else attach_rank_report(output, report)


def step_report_of(output: Any) -> StepReport | None:
    """The merged report an output brought to the scheduler, if any."""
    return STEP_REPORT.get(output)


def _report_in(reply: Any) -> RankReport | None:
    if isinstance(reply, RankReport):
        return reply
    return RANK_REPORT.get(reply)


class ReportMerger:
    """An output aggregator for one report step: vLLM's merge, plus the ranks' reports.

    ``inner``: the executor's own aggregator (None without a KV connector). Reports
    that arrive on a call whose merged result is ``None`` (``execute_model`` launched
    a forward) are kept for the step's next call, ``sample_tokens``, which shares
    this merger.
    """

    def __init__(self, inner: Any | None = None):
        self.inner = inner
        self._carried: list[RankReport] = []

    def aggregate(self, outputs: Sequence[Any], output_rank: int = 0) -> Any:
        reports = [r for r in map(_report_in, outputs) if r is not None]
        replies = [None if isinstance(o, RankReport) else o for o in outputs]  # what vLLM itself sent
        if self.inner is not None:
            result = self.inner.aggregate(replies, output_rank=output_rank)
        else:
            result = replies[output_rank]
        reports = self._carried + reports
        if result is None:
            self._carried = reports
            return None
        self._carried = []
        if reports:
            STEP_REPORT.put(result, StepReport(tuple(reports)))
        return result

    def __getattr__(self, name: str) -> Any:
        """Whatever else vLLM asks of an aggregator (a fault-tolerance hook from 0.33) is vLLM's own."""
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class ReportRouting:
    """Which executor calls gather every rank's reply: a report step's ``execute_model`` and the
    ``sample_tokens`` that follows it on the same executor. Every other call is left as vLLM makes it."""

    def __init__(self) -> None:
        self._awaiting_sample: "weakref.WeakKeyDictionary[Any, ReportMerger]" = weakref.WeakKeyDictionary()

    def execute(self, wrapped: Callable[..., Any], executor: Any, args: tuple, kwargs: dict) -> Any:
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        plan = PLAN.get(scheduler_output)
        if plan is None or not plan.report:
            self._awaiting_sample.pop(executor, None)
            return wrapped(*args, **kwargs)
        merger = ReportMerger(executor.kv_output_aggregator)
        self._awaiting_sample[executor] = merger
        return _with_aggregator(executor, merger, wrapped, args, kwargs)

    def sample(self, wrapped: Callable[..., Any], executor: Any, args: tuple, kwargs: dict) -> Any:
        merger = self._awaiting_sample.pop(executor, None)
        if merger is None:
            return wrapped(*args, **kwargs)
        return _with_aggregator(executor, merger, wrapped, args, kwargs)


def _with_aggregator(executor: Any, merger: ReportMerger, wrapped: Callable[..., Any], args: tuple,
                     kwargs: dict) -> Any:
    """One call with ``merger`` as the executor's aggregator (vLLM reads it as it builds the call;
    a non-blocking call's future keeps it), then vLLM's own again."""
    inner = executor.kv_output_aggregator
    executor.kv_output_aggregator = merger
    try:
        return wrapped(*args, **kwargs)
    finally:
        executor.kv_output_aggregator = inner
