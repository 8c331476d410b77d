"""The commands a scheduler sends its worker ranks, and the plan one step carries.

Commands are numbered by one counter per engine; every rank applies them in
that order, so "unmap g" then "map g" can never be swapped, and a spill copy
always runs before the unmap of the group it reads from. They are plain tuples
so that pickling them with the step costs next to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Tuple

MAP = "map"          # (seq, MAP, groups)
UNMAP = "unmap"      # (seq, UNMAP, groups)
STORE = "store"      # (seq, STORE, block_ids, slots, block_compute)
LOAD = "load"        # (seq, LOAD, block_ids, slots)
RESERVE = "reserve"  # (seq, RESERVE, pages): warm pages each rank keeps for fast mapping
WAIT = "wait"        # (seq, WAIT): the step's compute waits for every copy queued before it

#: Board value of a group mapped before the scheduler existed (start-up warm-up, the null block).
START_SEQ = 1

Command = Tuple  # (seq, kind, *arguments)


def map_command(seq: int, groups: Sequence[int]) -> Command:
    return (seq, MAP, tuple(groups))


def unmap_command(seq: int, groups: Sequence[int]) -> Command:
    return (seq, UNMAP, tuple(groups))


def store_command(seq: int, block_ids: Sequence[int], slots: Sequence[int], block_compute: bool) -> Command:
    return (seq, STORE, tuple(block_ids), tuple(slots), bool(block_compute))


def load_command(seq: int, block_ids: Sequence[int], slots: Sequence[int], block_compute: bool = True) -> Command:
    """``block_compute``: the step's forward pass waits for the copy (False: the rank reports it done)."""
    return (seq, LOAD, tuple(block_ids), tuple(slots), bool(block_compute))


def wait_command(seq: int) -> Command:
    return (seq, WAIT)


def reserve_command(seq: int, pages: int) -> Command:
    return (seq, RESERVE, int(pages))


@dataclass(frozen=True)
class StepPlan:
    """What one scheduling step tells every rank, attached to its ``SchedulerOutput``.

    ``step`` numbers the step (ranks report the last one they ran, so the
    scheduler knows when none is in flight); ``idle_upto`` is the last command
    sent outside a step while the engine was idle, which a rank must have
    applied before this plan's own ``commands``. ``report``: every rank must
    attach its :class:`~kvelastic.tp.step_report.RankReport` to this step's
    reply, and the executor must gather every rank's reply (a MAP awaits them).
    """

    step: int
    commands: tuple[Command, ...] = field(default_factory=tuple)
    idle_upto: int = 0
    report: bool = False
