"""How many more page groups the page-aware free queue could map now: its room, read briefly cached.

The free count vLLM reads, every rebalance of the queue and every load from
the host tier that finds no uncached free block ask it: dozens to thousands
of times a scheduling step. The answer walks the pool's source stack (limit,
shared account, device reading), so it is read from the pool at most once per
:data:`MAPPABLE_TTL_S` and again as soon as the queue maps, releases or is
refused a group (:meth:`MapRoom.forget`). Within that millisecond the pool's
limit or the account may move on another thread: the stale figure is then
what :meth:`PageAwareFreeQueue._overcommit` honours.
"""

from __future__ import annotations

from typing import Callable

from kvelastic.roles import Mapper, SchedulerCache
from kvelastic.scheduler.allocation_hold import AllocationHold
from kvelastic.scheduler.free_ledger import FreeBlockLedger

MAPPABLE_TTL_S = 0.001


class MapRoom:
    """``(groups, blocks)`` the pool could still map, beyond the groups ``ledger`` has mapped."""

    def __init__(self, cache: SchedulerCache, ledger: FreeBlockLedger, hold: AllocationHold, mapper: Mapper,
                 clock: Callable[[], float]):
        """``mapper``: whether it maps in this process (else no unmapped block is ever promised);
        ``clock``: when the cached figure was read (the queue's own clock)."""
        self.cache = cache
        self.ledger = ledger
        self.hold = hold
        self.mapper = mapper
        self.clock = clock
        self.valid_until = 0.0
        self._groups = 0
        self._blocks = 0

    def forget(self) -> None:
        """The pool's room changed (a group mapped, released or refused): read it again next time."""
        self.valid_until = 0.0

    def groups(self) -> int:
        """Groups the pool could still map."""
        now = self.clock()
        if now >= self.valid_until:
            self._read(now)
        return self._groups

    def blocks(self) -> int:
        """Blocks in groups the pool could still map: promised to vLLM as free.

        Zero when mapping is not synchronous (ranks in other processes must
        confirm a group first): blocks are promised only once really mapped;
        zero too for the rest of a step in which the device refused a map.
        """
        if not self.mapper.synchronous or self.hold.refused:
            return 0
        now = self.clock()
        if now >= self.valid_until:
            self._read(now)
        return self._blocks

    def _read(self, now: float) -> None:
        cache, ledger = self.cache, self.ledger
        groups = cache.mappable_groups(cache.num_groups - ledger.mapped_groups)
        self._groups = groups
        self._blocks = min(cache.num_blocks - ledger.mapped_blocks, groups * cache.blocks_per_group)
        self.valid_until = now + MAPPABLE_TTL_S
