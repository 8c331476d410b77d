"""How far every rank has pinned its share of the host tier: through the rank boards, or their reports.

Under tensor parallelism the host-tier index lives on the scheduler and each
rank pins its own buffer in the background (``offload/host_memory.py``). A
slot of the index may be handed out only once every rank has it pinned, so
each rank publishes its pinned prefix on its board and the scheduler's tier
reads the least of them at its next admission. No rank waits for another and
the scheduler never blocks: until every rank has a slot, admissions miss.

The count and "settled" travel in one int64 board field (one aligned store,
so a reader in another process never sees one without the other): ``n >= 0``
means n slots pinned and more may come; ``-(n + 1)`` means n slots, final.

With ``KVELASTIC_TP_CONFIRM=step`` the scheduler reads no board: each rank puts
the same pair in its step reports (:class:`~kvelastic.tp.step_report.RankReport`),
and :class:`ReportedHostSupply` keeps the last each rank said. A count a rank
reported was pinned when it reported it, so the least of them is safe to hand
out; until every rank has reported, it is 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvelastic.tp import board as shm
from kvelastic.tp.step_report import RankReport

if TYPE_CHECKING:
    from kvelastic.tp.rank_board import Board


def encode(ready_slots: int, settled: bool) -> int:
    return -(ready_slots + 1) if settled else ready_slots


def decode(value: int) -> tuple[int, bool]:
    """(ready slots, settled) from a board's field."""
    return (-value - 1, True) if value < 0 else (value, False)


def publish(board: "Board", ready_slots: int, settled: bool) -> None:
    """The rank's side, called from its pin threads (the field has no other writer)."""
    board.set(shm.HOST_PINNED, encode(ready_slots, settled))


class RankHostSupply:
    """The scheduler's :class:`~kvelastic.offload.host_memory.SlotSupply`: the least pinned prefix of all ranks."""

    def __init__(self, boards: Sequence[shm.RankBoard]):
        self.boards = list(boards)

    def _states(self) -> list[tuple[int, bool]]:
        return [decode(b.get(shm.HOST_PINNED)) for b in self.boards]

    @property
    def ready_slots(self) -> int:
        return min(ready for ready, _ in self._states())

    @property
    def settled(self) -> bool:
        return all(settled for _, settled in self._states())


class ReportedHostSupply:
    """The scheduler's :class:`~kvelastic.offload.host_memory.SlotSupply` in ``STEP`` mode: the least pinned
    prefix the ranks reported on the steps' replies (fed by ``RemoteMapper.adopt``).

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
