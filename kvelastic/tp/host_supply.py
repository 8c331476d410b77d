"""How far every rank has pinned its share of the host tier, from the reports on the steps' replies.

Under tensor parallelism the host-tier index lives on the scheduler and each
rank pins its own buffer in the background (``offload/host_memory.py``). A
slot of the index may be handed out only once every rank has it pinned, so
each rank puts its pinned prefix and whether it is final in its step reports
(:class:`~kvelastic.tp.step_report.RankReport`), and :class:`ReportedHostSupply`
keeps the last each rank said. A count a rank reported was pinned when it
reported it, so the least of them is safe to hand out; until every rank has
reported, it is 0. No rank waits for another and the scheduler never blocks:
until every rank has a slot, admissions miss.
"""

from __future__ import annotations

from typing import Sequence

from kvelastic.tp.step_report import RankReport


class ReportedHostSupply:
    """The scheduler's :class:`~kvelastic.offload.host_memory.SlotSupply`: the least pinned prefix the ranks
    reported on the steps' replies (fed by ``RemoteMapper.adopt``).

    Both answers only grow, as the protocol asks: a rank's pinned prefix only grows, and a rank's count and
    "settled" arrive together in one report, so once every rank said "settled" the least count is final.
    """

    def __init__(self, world: int):
        self.world = world
        self._states: dict[int, tuple[int, bool]] = {}  # rank -> (ready slots, settled), as last reported

    def take(self, reports: Sequence[RankReport]) -> None:
        """Keep each rank's latest word (a count never shrinks: a report can only be as new as the last)."""
        for report in reports:
            ready, settled = self._states.get(report.rank, (0, False))
            self._states[report.rank] = (max(ready, report.host_ready), settled or report.host_settled)

    @property
    def ready_slots(self) -> int:
        return min(self._states.get(rank, (0, False))[0] for rank in range(self.world))

    @property
    def settled(self) -> bool:
        return all(self._states.get(rank, (0, False))[1] for rank in range(self.world))
