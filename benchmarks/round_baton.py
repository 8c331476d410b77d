"""Taking turns: several engines alive at once, one round each in turn (``bench_multiturn.py --interleave``).

Why: on the lent GPU machines a round of the same work ran anywhere from 4.8 to 7.6 s, and a
whole stretch of rounds together fast or slow (every turn of a round moved with it), so configurations run one after another met different stretches of the machine, and
their medians moved 3.5-16 % from call to call. With every engine started first and the
rounds dealt out in turn (config A's round r, then B's, then C's, the order rotated each
round), neighbouring rounds of two configurations meet the same stretch, and the ratio of
their throughputs in one round (a paired ratio) cancels what the machine did.

The conductor (the parent) and the players (one engine process each) talk through empty
files in one private directory: a player touches ``ready-<name>`` once its engine is up,
waits for ``go-<name>-<round>``, runs the round, then touches ``done-<name>-<round>``.
Nothing is read from the files but their names; the directory is the caller's own
(``tempfile.mkdtemp``: mode 0700).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Sequence

POLL_S = 0.005


class ConductorGone(RuntimeError):
    """A player waited longer for its turn than any round takes: the conductor is gone."""


class Player:
    """The engine's side: say ready, wait for each round's turn, say done."""

    def __init__(self, directory: str | Path, name: str, timeout_s: float = 3600.0):
        self.directory = Path(directory)
        self.name = name
        self.timeout_s = timeout_s

    def ready(self) -> None:
        (self.directory / f"ready-{self.name}").touch()

    def wait_turn(self, round_index: int) -> None:
        _wait_for(self.directory / f"go-{self.name}-{round_index}", self.timeout_s)

    def done(self, round_index: int) -> None:
        (self.directory / f"done-{self.name}-{round_index}").touch()


class Conductor:
    """The parent's side: wait for every engine, then deal the rounds out one at a time."""

    def __init__(self, directory: str | Path, players: dict[str, subprocess.Popen]):
        self.directory = Path(directory)
        self.players = players
        self.gone: set[str] = set()

    def wait_ready(self) -> list[str]:
        """Wait until every live player is ready; return those that are (the others exited)."""
        for name in self.players:
            self._wait(name, f"ready-{name}")
        return [name for name in self.players if name not in self.gone]

    def play_round(self, round_index: int) -> list[str]:
        """Give each live player its turn at ``round_index``, one after another; return the order."""
        order = rotated([n for n in self.players if n not in self.gone], round_index)
        for name in order:
            (self.directory / f"go-{name}-{round_index}").touch()
            self._wait(name, f"done-{name}-{round_index}")
        return order

    def _wait(self, name: str, flag: str) -> None:
        path = self.directory / flag
        process = self.players[name]
        while not path.exists():
            if process.poll() is not None:
                self.gone.add(name)
                return
            time.sleep(POLL_S)


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` starting at position ``round_index`` (mod their count): each leads as often."""
    if not names:
        return []
    k = round_index % len(names)
    return [*names[k:], *names[:k]]


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise ConductorGone(f"no {path.name} after {timeout_s:.0f} s: is the conductor still running?")
        time.sleep(POLL_S)
