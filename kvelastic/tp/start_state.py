"""What the ranks had done before their scheduler existed, and what the scheduler makes of it.

A rank maps some page groups while vLLM starts (the null block's group, a
warm-up) and its applied-command mark starts where its board says. The
scheduler must begin from the same picture on every rank: a group every rank
mapped is adopted (its blocks may be handed out at once), a group only some
ranks mapped is unmapped with the first step (a block of it would be missing on
the others), and the commands it sends are numbered on from the highest mark,
so that no rank skips a number it has seen as applied.

Two sources give that picture: the ranks' boards in the engine's shared-memory
folder (:func:`of_boards`, ``KVELASTIC_TP_CONFIRM=board``: one host), or the
descriptions the ranks send back (:func:`of_descriptions`, ``step``), which
come over vLLM's ``collective_rpc`` under Ray, so the scheduler opens no board.
Both read the same moment: a rank's board is created new when it describes
itself and only the scheduler's commands change it afterwards, and there are
none before the scheduler exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvelastic.tp import board as shm
from kvelastic.tp.protocol import START_SEQ
from kvelastic.tp.rank_files import RankInfo


@dataclass(frozen=True)
class StartState:
    """The scheduler's start: groups to adopt, groups to unmap with the first step, the last command number."""

    adopted: tuple[int, ...] = ()
    partial: tuple[int, ...] = ()
    applied: int = START_SEQ


def _combine(mapped: Sequence[set[int]], marks: Sequence[int]) -> StartState:
    everywhere = set.intersection(*mapped) if mapped else set()
    anywhere = set.union(*mapped) if mapped else set()
    return StartState(adopted=tuple(sorted(everywhere)), partial=tuple(sorted(anywhere - everywhere)),
                      applied=max([*marks, START_SEQ]))


def of_boards(boards: Sequence[shm.RankBoard], num_groups: int) -> StartState:
    """From the ranks' boards (``board`` mode): a group counts as mapped where a board shows a command for it."""
    mapped = [{g for g in range(num_groups) if int(b.groups[g]) > 0} for b in boards]
    return _combine(mapped, [b.get(shm.APPLIED) for b in boards])


def of_descriptions(infos: Sequence[RankInfo]) -> StartState:
    """From the ranks' descriptions (``step`` mode): what each said it had mapped, and its mark."""
    return _combine([set(i.start_groups) for i in infos], [i.applied for i in infos])
