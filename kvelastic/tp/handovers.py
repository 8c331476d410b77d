"""What the engine core's executor learnt from its worker ranks, kept for its scheduler.

The executor's wrap (:mod:`kvelastic.tp.executor_handover`) asks the ranks for
their descriptions before the scheduler exists and holds no handle the
scheduler could reach, so the record lives on the process's
:class:`~kvelastic.startup.runtime.Runtime`, which both are bound to: one engine
core per process, so one record, never a module global.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from kvelastic.tp.rank_info import RankInfo


class RankHandovers:
    """Whether a multiprocess executor (vLLM's own, or Ray's V2) asked its ranks, and what they described."""

    def __init__(self) -> None:
        self._asked = False
        self._infos: tuple["RankInfo", ...] | None = None
        self._lock = threading.Lock()

    def asked(self) -> None:
        """The executor asked every rank for its description (it gathers every rank's reply)."""
        with self._lock:
            self._asked = True

    def keep_descriptions(self, infos: Sequence["RankInfo"]) -> None:
        """The ranks' descriptions, in rank order."""
        with self._lock:
            self._infos = tuple(infos)

    @property
    def was_asked(self) -> bool:
        """Whether this engine's executor is one whose ranks kvelastic reaches: it asked them."""
        with self._lock:
            return self._asked

    def described(self) -> tuple["RankInfo", ...] | None:
        """The descriptions every rank sent back, in rank order; None unless each rank sent its own."""
        with self._lock:
            return self._infos
