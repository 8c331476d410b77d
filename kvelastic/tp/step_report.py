"""What a rank tells its scheduler on a step's reply, and how the ranks' words are combined.

A report rides the reply vLLM already sends back for a step
(:mod:`kvelastic.tp.report_merger`), so confirmations need no channel of their
own and cross hosts as the steps do. Every rank runs the same commands, so a
MAP's outcome on a rank is a single count: how many of the command's groups it
mapped (a rank maps a prefix and refuses the rest). The ranks' words combine as
the minimum. A command is decided only once every rank has spoken. Everything
is plain ints and tuples, so pickling a report with the step costs next to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class RankReport:
    """One rank's news since its last report.

    ``maps``: ``(seq, done)`` for each MAP command run, where ``done`` of its
    groups were mapped (the rest refused). ``loads``: the asynchronous LOAD
    commands whose copies finished. ``device_free`` is -1 when unknown.
    ``host_ready``: the slots of its host-tier share pinned so far (a prefix);
    ``host_settled``: no more will come (:mod:`kvelastic.tp.host_supply`).
    """

    rank: int
    applied: int
    step: int
    maps: tuple[tuple[int, int], ...] = ()
    loads: tuple[int, ...] = ()
    device_free: int = -1
    held_bytes: int = 0
    mapped_bytes: int = 0
    host_ready: int = 0
    host_settled: bool = False


@dataclass(frozen=True)
class StepReport:
    """Every rank's report from one step's replies (what the scheduler adopts)."""

    ranks: tuple[RankReport, ...] = field(default_factory=tuple)


class CommandTally:
    """Per command, the least count any rank reported, once every rank has reported it.

    The scheduler side's record of outcomes still missing a rank. ``entries``
    picks a rank report's ``(seq, count)`` pairs: by default its MAPs (groups
    mapped); an asynchronous load's is ``(seq, 1)``. A rank's report is
    consumed once: a later report never repeats a seq.
    """

    def __init__(self, world: int,
                 entries: Callable[[RankReport], Iterable[tuple[int, int]]] = lambda report: report.maps):
        self.world = world
        self.entries = entries
        self._seen: dict[int, dict[int, int]] = {}  # seq -> rank -> count

    def add(self, report: StepReport) -> dict[int, int]:
        """Take ``report``'s entries; return ``{seq: least done}`` for each seq now decided by all ranks."""
        decided: dict[int, int] = {}
        for rank_report in report.ranks:
            if not 0 <= rank_report.rank < self.world:
                raise ValueError(f"a report from rank {rank_report.rank} of a world of {self.world}")
            for seq, done in self.entries(rank_report):
                counts = self._seen.setdefault(seq, {})
                counts[rank_report.rank] = done
                if len(counts) == self.world:
                    decided[seq] = min(counts.values())
                    del self._seen[seq]
        return decided

    def undecided(self) -> list[int]:
        """Seqs some rank has reported and another has not."""
        return sorted(self._seen)

    def drop(self, seqs: Iterable[int]) -> None:
        """Forget seqs the scheduler gave up on (refused after waiting too long)."""
        for seq in seqs:
            self._seen.pop(seq, None)


def split_map(groups: Sequence[int], done: int) -> tuple[list[int], list[int]]:
    """A MAP's groups as (mapped on every rank, refused by some rank), from the least count."""
    done = max(0, min(done, len(groups)))
    return list(groups[:done]), list(groups[done:])


def held_by_rank(reports: Sequence[RankReport], world: int,
                 previous: Mapping[int, int] | None = None) -> list[int]:
    """Each rank's held bytes, latest report first, else the previous value, else 0."""
    held = dict(previous or {})
    for r in reports:
        held[r.rank] = r.held_bytes
    return [held.get(rank, 0) for rank in range(world)]
