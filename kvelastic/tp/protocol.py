"""The commands a scheduler sends its worker ranks, and the plan one step carries.

Commands are numbered by one counter per engine; every rank applies them in
that order, so "unmap g" then "map g" can never be swapped, and a spill copy
always runs before the unmap of the group it reads from. The one exception is
a MAP that no later command of its plan touches: a rank may apply it after the
step's forward pass is launched (:func:`maps_after_launch`). They are plain
tuples so that pickling them with the step costs next to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, Tuple

MAP = "map"          # (seq, MAP, groups)
UNMAP = "unmap"      # (seq, UNMAP, groups)
STORE = "store"      # (seq, STORE, block_ids, slots, block_compute)
LOAD = "load"        # (seq, LOAD, block_ids, slots)
RESERVE = "reserve"  # (seq, RESERVE, pages): warm pages each rank keeps for fast mapping
WAIT = "wait"        # (seq, WAIT): the step's compute waits for every copy queued before it

#: The command number of the maps a rank made before its scheduler existed (start-up warm-up, the null
#: block); the scheduler numbers its own commands from above it.
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


def maps_after_launch(commands: Sequence[Command], group_of_block: Callable[[int], int]) -> frozenset[int]:
    """The seqs of the MAP commands a rank may apply after launching the step's forward pass.

    A MAP backs no block of its own step: the scheduler hands out blocks only from
    groups every rank has confirmed, and a rank confirms a group only once it has
    mapped it. So a MAP may move behind the forward pass, and behind the plan's later
    commands, unless one of those touches its groups: a later UNMAP, a STORE or
    LOAD of one of their blocks, or another MAP of them (kept in order with it).
    The scheduler never sends such a plan (it asks to map only unmapped groups not
    already asked for, frees, spills and loads blocks only of confirmed ones, and
    refuses a group only on a report of the step that carried its MAP); should a
    plan do so, such a MAP stays in its place and the rank counts it.
    """
    first = next((i for i, command in enumerate(commands) if command[1] == MAP), None)
    if first is None:
        return frozenset()
    touched: set[int] = set()  # groups the commands after the one being looked at touch
    later: list[int] = []
    for command in reversed(commands[first:]):
        kind = command[1]
        if kind == MAP:
            if touched.isdisjoint(command[2]):
                later.append(command[0])
            touched.update(command[2])
        elif kind == UNMAP:
            touched.update(command[2])
        elif kind in (STORE, LOAD):
            touched.update(group_of_block(block_id) for block_id in command[2])
    return frozenset(later)


@dataclass(frozen=True)
class StepPlan:
    """What one scheduling step tells every rank, attached to its ``SchedulerOutput``.

    ``step`` numbers the step (ranks report the last one they ran). ``report``:
    every rank must attach its :class:`~kvelastic.tp.step_report.RankReport` to
    this step's reply, and the executor must gather every rank's reply (a MAP
    awaits them).
    """

    step: int
    commands: tuple[Command, ...] = field(default_factory=tuple)
    report: bool = False
