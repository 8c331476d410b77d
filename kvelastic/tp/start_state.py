"""What the ranks had done before their scheduler existed, and what the scheduler makes of it.

A rank maps some page groups while vLLM starts (the null block's group, a
warm-up) and starts its applied-command mark at 0. The scheduler must begin
from the same picture on every rank: a group every rank mapped is adopted (its
blocks may be handed out at once), a group only some ranks mapped is unmapped
with the first step (a block of it would be missing on the others), and the
commands it sends are numbered on from the highest mark, so that no rank skips
a number it has seen as applied. The picture comes in the descriptions the
ranks send back over vLLM's ``collective_rpc``, each taken when the engine core
asks, once vLLM's start-up (warm-up and CUDA graph capture included) is over and
before any command: nothing changes a rank's maps in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvelastic.tp.protocol import START_SEQ
from kvelastic.tp.rank_info import RankInfo


@dataclass(frozen=True)
class StartState:
    """The scheduler's start: groups to adopt, groups to unmap with the first step, the last command number."""

    adopted: tuple[int, ...] = ()
    partial: tuple[int, ...] = ()
    applied: int = START_SEQ


def of_descriptions(infos: Sequence[RankInfo]) -> StartState:
    """From the ranks' descriptions: what each said it had mapped, and its mark."""
    mapped = [set(i.start_groups) for i in infos]
    everywhere = set.intersection(*mapped) if mapped else set()
    anywhere = set.union(*mapped) if mapped else set()
    return StartState(adopted=tuple(sorted(everywhere)), partial=tuple(sorted(anywhere - everywhere)),
                      applied=max([*(i.applied for i in infos), START_SEQ]))
