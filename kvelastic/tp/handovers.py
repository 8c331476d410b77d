"""What the engine core handed to a Ray executor's ranks, kept for its scheduler.

The executor's wrap (:mod:`kvelastic.tp.ray_executor`) runs before the
scheduler exists and holds no handle the scheduler could reach, so the record
lives on the process's :class:`~kvelastic.startup.runtime.Runtime`, which both
are bound to: one engine core per process, so one record, never a module global.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from kvelastic.tp.rank_files import RankInfo


class RayHandovers:
    """The engine folders handed to a Ray V2 executor's ranks, with the descriptions they sent back."""

    def __init__(self) -> None:
        self._folders: dict[Path, tuple["RankInfo", ...] | None] = {}
        self._elsewhere: dict[Path, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def handed(self, folder: Path, elsewhere: Sequence[int] = ()) -> None:
        """``folder`` went to every rank; no description yet. ``elsewhere``: the pids of the ranks that said
        they are on another host (they took no folder: step confirmations)."""
        with self._lock:
            self._folders[folder] = None
            self._elsewhere[folder] = tuple(elsewhere)

    def ranks_elsewhere(self, folder: Path) -> tuple[int, ...]:
        """The pids of the ranks ``folder`` was handed to that run on another host (none: all on this one)."""
        with self._lock:
            return self._elsewhere.get(folder, ())

    def keep_descriptions(self, folder: Path, infos: Sequence["RankInfo"]) -> None:
        """The ranks' descriptions of ``folder``'s engine, in rank order."""
        with self._lock:
            self._folders[folder] = tuple(infos)

    def handed_over(self, folder: Path) -> bool:
        """Whether ``folder`` was handed to a Ray executor's ranks: then that executor is Ray's V2, a
        ``MultiprocExecutor`` (any other was refused first), which gathers every rank's reply as ``mp`` does."""
        with self._lock:
            return folder in self._folders

    def described(self, folder: Path) -> tuple["RankInfo", ...] | None:
        """The descriptions the ranks ``folder`` was handed to sent back, in rank order; None if none came."""
        with self._lock:
            return self._folders.get(folder)

    def forget(self, folder: Path) -> None:
        """Forget a hand-over (an engine core that shut down)."""
        with self._lock:
            self._folders.pop(folder, None)
            self._elsewhere.pop(folder, None)
