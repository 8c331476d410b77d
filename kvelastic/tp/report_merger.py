"""Carry rank reports on vLLM's step replies, and merge them where vLLM merges KV-connector outputs.

vLLM's multiprocess executors (Ray V2 included) take every rank's reply to a step only when
an output aggregator is passed to ``collective_rpc``; otherwise only the output rank
answers. On the steps whose plan asks for a report, the executor is handed a
:class:`ReportMerger` for that call. It pulls each rank's report off its reply, lets vLLM's
own aggregator (the user's KV connector's, if any) merge the rest, and puts the ranks'
reports together on the output that reaches the scheduler. The merger is duck-typed (vLLM
calls only ``aggregate(outputs, output_rank=...)``), so nothing of vLLM is imported here.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from kvelastic.tp.step_report import RankReport, StepReport

#: The attribute a rank's reply carries its :class:`RankReport` in, and the merged output its :class:`StepReport`.
RANK_ATTR = "kvelastic_rank_report"
STEP_ATTR = "kvelastic_report"


def attach_rank_report(output: Any, report: RankReport) -> Any:
    """``output`` (a ModelRunnerOutput) with ``report`` on it: a shallow copy, since vLLM
    shares one empty output object among all steps that have nothing to say."""
    carrier = copy.copy(output)
    setattr(carrier, RANK_ATTR, report)
    return carrier


def step_report_of(output: Any) -> StepReport | None:
    """The merged report an output brought to the scheduler, if any."""
    return getattr(output, STEP_ATTR, None)


class ReportMerger:
    """An output aggregator for one report step: vLLM's merge, plus the ranks' reports.

    ``inner``: the executor's own aggregator (None without a KV connector). A
    report that arrives on a reply merged into nothing (every rank answered
    ``None``) is kept for the next call: a step's two replies (``execute_model``,
    ``sample_tokens``) may share one merger.
    """

    def __init__(self, inner: Any | None = None):
        self.inner = inner
        self._carried: list[RankReport] = []

    def aggregate(self, outputs: Sequence[Any], output_rank: int = 0) -> Any:
        reports = [r for r in (getattr(o, RANK_ATTR, None) for o in outputs if o is not None) if r is not None]
        if self.inner is not None:
            result = self.inner.aggregate(list(outputs), output_rank=output_rank)
        else:
            result = outputs[output_rank]
        reports = self._carried + reports
        if result is None:
            self._carried = reports
            return None
        self._carried = []
        if reports:
            setattr(result, STEP_ATTR, StepReport(tuple(reports)))
        return result
