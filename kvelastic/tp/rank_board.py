"""A rank's board as a role: the shared-memory file of one host, or the same values kept in the rank.

A rank keeps its pid, applied mark, last step, memory figures, pinned host
slots and per-group map states on a board (``kvelastic.tp.board``'s field
numbers). On the engine core's host the board is a file in the engine's folder
(:class:`~kvelastic.tp.board.RankBoard`), which board mode and idle delivery read.
A rank on another host (Ray, ``KVELASTIC_TP_CONFIRM=step``) has no folder: the
same values stay in its own memory (:class:`InProcessBoard`), where its step
reports read them, and nothing of it is written anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from kvelastic.tp.board import DEVICE_FREE, HEADER, RankBoard


class Board(Protocol):
    """What a rank writes and reads of its own board (one writer: the rank)."""

    groups: np.ndarray  # per page group: the command that mapped it, -seq refused, 0 unmapped

    def get(self, field: int) -> int: ...

    def set(self, field: int, value: int) -> None: ...


class InProcessBoard:
    """A board no other process reads: a rank with no engine folder (on another host than its engine core)."""

    def __init__(self, num_groups: int):
        self.array = np.zeros(HEADER + num_groups, dtype=np.int64)
        self.array[DEVICE_FREE] = -1  # as a new board file: not measured yet
        self.header = self.array[:HEADER]
        self.groups = self.array[HEADER:]

    def get(self, field: int) -> int:
        return int(self.header[field])

    def set(self, field: int, value: int) -> None:
        self.header[field] = value


def rank_board(folder: Path | None, rank: int, num_groups: int) -> Board:
    """Rank ``rank``'s board: its file in ``folder``, created new, or kept in memory where it has no folder."""
    if folder is None:
        return InProcessBoard(num_groups)
    return RankBoard.of_rank(folder, rank, num_groups, create=True)
