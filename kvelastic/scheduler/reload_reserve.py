"""How much warm memory the next long reload from the host tier would want.

A reload of a long prefix from the host tier maps every page group its
blocks land in before the step's forward pass can start: a 16k-token 8B
prefix is eight groups, 2 GiB of physical pages created and mapped in front
of the step. The warm reserve (:class:`~kvelastic.scheduler.reclaimer.WarmReserve`)
keeps pages created and parked at the groups mapped next, so that mapping
them costs no driver call. Its usual size (``KVELASTIC_RESERVE``) covers a
burst of new blocks, not such a run.

:class:`ReloadReserve` says how far the reserve should grow to cover one:
the longest run of host hits loaded within the last minute
(:class:`~kvelastic.offload.host_runs.HostRuns`), in whole page groups, at
most what the host tier still holds and at most :data:`MAX_BYTES`. Memory is thus
held only for reloads that happened lately and could happen again; the
warm reserve holds it only while the engine is busy and nobody else on the
GPU waits, and within the limit and the account's room (which count warm
pages), as it does its usual size.
"""

from __future__ import annotations

from typing import Callable

from kvelastic.offload.host_runs import HostRuns
from kvelastic.roles import SchedulerCache

#: The most the warm reserve grows to for reloads: a 16k-token 8B prefix (eight page groups). On an H100 it
#: took a busy engine's reload of one from 84 to 64 ms (docs/offload.md).
MAX_BYTES = 2048 * 1024 * 1024


class ReloadReserve:
    """Bytes of page groups the longest recent host run would map, capped by ``cap_bytes`` and the tier."""

    def __init__(self, runs: HostRuns, cache: SchedulerCache, host_blocks: Callable[[], int],
                 cap_bytes: int = MAX_BYTES):
        """``host_blocks``: blocks the host tier holds now (a run cannot come back longer than that)."""
        self.runs = runs
        self.cache = cache
        self.host_blocks = host_blocks
        self.cap_bytes = cap_bytes

    def bytes_wanted(self, now: float) -> int:
        """Whole page groups for the longest run loaded within the window, at most ``cap_bytes`` (0: none)."""
        blocks = min(self.runs.longest(now), self.host_blocks())
        if blocks <= 0 or self.cap_bytes <= 0:
            return 0
        per_group = max(1, self.cache.blocks_per_group)
        groups = -(-blocks // per_group)
        return min(self.cap_bytes, groups * self.cache.group_bytes)
