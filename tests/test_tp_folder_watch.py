"""The rank's idle thread lists the engine folder only when it may have changed (kvelastic/tp/folder_watch.py).

A missed idle file would leave a command unapplied while the engine idles, so
every way a change shows is checked: an entry created, renamed in or removed; a
folder changed too recently for its timestamp to be trusted; the periodic full
look; a folder that cannot be read. Clocks are the test's, so nothing sleeps.
"""

from __future__ import annotations

import os

from kvelastic.tp.folder_watch import QUIET_NS, RECHECK_S, FolderWatch


class Clocks:
    """A monotonic clock and a wall clock the test moves; the wall clock starts well after the folder's mtime."""

    def __init__(self, folder) -> None:
        self.now = 0.0
        self.wall = os.stat(folder).st_mtime_ns + 10 * QUIET_NS

    def watch(self, folder) -> FolderWatch:
        return FolderWatch(folder, clock=lambda: self.now, wall_ns=lambda: self.wall)


def _touch_later(folder, clocks: Clocks, name: str) -> None:
    """Create ``name`` and move the wall clock past its quiet period (as if the next tick came later)."""
    (folder / name).write_bytes(b"x")
    clocks.wall = max(clocks.wall, os.stat(folder).st_mtime_ns) + 2 * QUIET_NS


def test_an_unchanged_folder_is_listed_once_then_not_until_it_changes(tmp_path):
    clocks = Clocks(tmp_path)
    watch = clocks.watch(tmp_path)
    assert watch.should_look()
    assert not watch.should_look() and not watch.should_look()
    _touch_later(tmp_path, clocks, "idle-000000000002-000000000003.cmd")
    assert watch.should_look(), "a new file must be looked for"
    assert not watch.should_look()
    os.rename(tmp_path / "idle-000000000002-000000000003.cmd", tmp_path / "idle-000000000002-000000000004.cmd")
    clocks.wall += 2 * QUIET_NS
    assert watch.should_look(), "a renamed file must be looked for"
    (tmp_path / "idle-000000000002-000000000004.cmd").unlink()
    clocks.wall += 2 * QUIET_NS
    assert watch.should_look(), "a removal changes the folder too"


def test_a_folder_changed_within_the_timestamp_tick_is_looked_at_until_it_is_older(tmp_path):
    """The same mtime could hide a second change made in the same coarse clock tick."""
    clocks = Clocks(tmp_path)
    watch = clocks.watch(tmp_path)
    (tmp_path / "a").write_bytes(b"x")
    clocks.wall = os.stat(tmp_path).st_mtime_ns + QUIET_NS // 2
    assert watch.should_look() and watch.should_look() and watch.should_look()
    clocks.wall += QUIET_NS
    assert watch.should_look()  # the first look once it is quiet: now trusted
    assert not watch.should_look()


def test_a_full_look_comes_at_least_every_recheck_period(tmp_path):
    clocks = Clocks(tmp_path)
    watch = clocks.watch(tmp_path)
    assert watch.should_look()
    clocks.now += RECHECK_S * 0.9
    assert not watch.should_look()
    clocks.now += RECHECK_S * 0.2
    assert watch.should_look()
    assert not watch.should_look()


def test_a_missing_folder_and_a_failed_look_are_looked_at_again(tmp_path):
    clocks = Clocks(tmp_path)
    missing = clocks.watch(tmp_path / "gone")
    assert missing.should_look() and missing.should_look()
    watch = clocks.watch(tmp_path)
    assert watch.should_look() and not watch.should_look()
    watch.forget()
    assert watch.should_look()
