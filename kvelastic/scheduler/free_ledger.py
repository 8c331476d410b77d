"""Which free blocks each page group holds: the books under the page-aware free queue.

Per group it keeps how many blocks are in use, how many free blocks still hold
a cached prefix, when a block of it was last taken or freed, and, for a mapped
group, which free blocks hold nothing. Across groups it keeps the cached free
blocks in LRU order (vLLM's eviction order), the mapped groups with a free
block (lowest first: blocks are handed out from the lowest), the unmapped
groups (lowest first: mapped next), the mapped groups that are empty, and every
free block of a mapped group in vLLM's own free-queue order
(:class:`~kvelastic.scheduler.free_order.FreeOrder`, what a connector's walk
of the free queue sees).

It decides nothing: the queue chooses what to map, release and evict, and the
ledger keeps the counts right. It sees block ids and hashes, never the pool.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, Callable, Iterable

from kvelastic.scheduler.elastic_cache import NULL_GROUP
from kvelastic.scheduler.free_order import BlockOrder, FreeOrder, UntrackedOrder
from kvelastic.roles import SchedulerCache


class FreeBlockLedger:
    """The free blocks of one block pool, grouped by page group."""

    def __init__(self, layout: SchedulerCache, blocks: list[Any], free_blocks: Iterable[Any],
                 is_mapped: Callable[[int], bool], *, keep_order: bool = True):
        """Start from vLLM's free blocks (every other block is in use) and the groups mapped now.

        ``keep_order``: keep vLLM's free-queue order too (for a connector that walks it).
        """
        self.layout = layout
        # A group is blocks_per_group consecutive blocks (KVGroupLayout): asked for every block taken or
        # freed, thousands of times a step with the host tier, so divided here rather than asked.
        self._per_group = per_group = layout.layout.blocks_per_group
        last = layout.num_groups * per_group - 1
        if layout.group_of_block(last) != last // per_group:
            raise AssertionError("internal: the free-block ledger expects groups of consecutive blocks")
        self._blocks = blocks
        groups = layout.num_groups
        self.in_use = [len(layout.blocks_of_group(g)) for g in range(groups)]
        self.cached_count = [0] * groups
        self.last_used = [0.0] * groups
        self.empty: set[int] = set()  # mapped groups with no block in use or cached
        self.held: set[int] = set()  # groups a connector's copy may still read: not released
        self.mapped_blocks = 0
        self._free_uncached: dict[int, set[int]] = {}  # a key per mapped group
        self._free_uncached_total = 0
        self._cached: OrderedDict[int, Any] = OrderedDict()
        self._open: list[int] = []  # a heap of groups that may have free uncached blocks
        self._unmapped = [g for g in range(groups) if not is_mapped(g)]  # a heap
        # the free blocks below, in the order vLLM's queue would keep them
        self.order: BlockOrder = FreeOrder() if keep_order else UntrackedOrder()
        for g in range(groups):
            if is_mapped(g):
                self.adopt_group(g, free=False)
        free = list(free_blocks)
        for block in free:
            self.in_use[layout.group_of_block(block.block_id)] -= 1
        used_unmapped = [g for g in self._unmapped if self.in_use[g]]
        if used_unmapped:
            raise AssertionError(f"blocks in use in unmapped groups {used_unmapped[:5]} at install")
        for block in free:
            if is_mapped(layout.group_of_block(block.block_id)):
                self.to_free(block)
        self.num_in_use = sum(self.in_use)
        self.order.mark_fresh()
        self.note_empty(set(self._free_uncached))  # groups mapped for start-up warm-up

    # ------------------------------------------------------------------ counts
    @property
    def free_in_mapped(self) -> int:
        """Free blocks in mapped groups, cached or not: what can be had without mapping."""
        return self._free_uncached_total + len(self._cached)

    @property
    def mapped_groups(self) -> int:
        return len(self._free_uncached)

    def is_mapped(self, group: int) -> bool:
        return group in self._free_uncached

    def cached_groups(self) -> int:
        """Groups holding cached blocks and none in use: what can be given back without preempting."""
        return sum(1 for g, n in enumerate(self.cached_count) if n and not self.in_use[g])

    def all_free_blocks(self) -> list[Any]:
        """Every free block in eviction order: uncached first, then cached LRU, then unmapped."""
        groups = self._free_uncached
        uncached = [self._blocks[b] for g in sorted(groups) for b in sorted(groups[g])]
        unmapped = [self._blocks[b] for g in range(self.layout.num_groups) if g not in groups
                    for b in self.layout.blocks_of_group(g)]
        return uncached + list(self._cached.values()) + unmapped

    # ------------------------------------------------------------------ groups
    def adopt_group(self, g: int, *, free: bool) -> None:
        """Start tracking a newly mapped group; with ``free`` all its blocks are free."""
        self.mapped_blocks += len(self.layout.blocks_of_group(g))
        self._free_uncached[g] = set()
        if free:
            members = self.layout.blocks_of_group(g)
            for block_id in members:
                self._add_uncached(g, block_id)
            self.order.add_fresh(self._blocks[b] for b in members)
            self.empty.add(g)

    def release_empty(self, groups: list[int]) -> list[int]:
        """Stop tracking those of ``groups`` that are empty; return them (to be unmapped)."""
        groups = [g for g in groups if g in self.empty and g not in self.held]
        self.empty.difference_update(groups)
        for g in groups:
            members = self._free_uncached.pop(g)
            self._free_uncached_total -= len(members)
            self.order.unlink_all((self._blocks[b] for b in members), restart=True)
            self.mapped_blocks -= len(self.layout.blocks_of_group(g))
            heapq.heappush(self._unmapped, g)
        return groups

    def pop_unmapped(self, count: int, exclude: set[int]) -> list[int]:
        """Up to ``count`` unmapped groups, lowest first, none of them in ``exclude``."""
        groups: list[int] = []
        while self._unmapped and len(groups) < count:
            g = heapq.heappop(self._unmapped)
            if g not in self._free_uncached and g not in exclude:
                groups.append(g)
        return groups

    def return_unmapped(self, g: int) -> None:
        """A group popped to be mapped stays unmapped (the pool refused it)."""
        heapq.heappush(self._unmapped, g)

    def cache_only_groups(self) -> list[tuple[float, int]]:
        """``(last_used, group)`` of groups holding cached blocks and none in use, oldest first."""
        return sorted((self.last_used[g], g) for g in range(len(self.cached_count))
                      if self.cached_count[g] and not self.in_use[g] and g != NULL_GROUP
                      and g not in self.held)

    def cached_blocks_in(self, groups: list[int]) -> list[Any]:
        return [self._cached[b] for g in groups for b in self.layout.blocks_of_group(g) if b in self._cached]

    def note_empty(self, groups: Iterable[int]) -> None:
        """Of ``groups``, the mapped ones now holding no block in use or cached are empty."""
        for g in groups:
            if g != NULL_GROUP and g in self._free_uncached and not self.in_use[g] \
                    and not self.cached_count[g]:
                self.empty.add(g)

    # ------------------------------------------------------------------ blocks
    def take_uncached(self, n: int, taken: list[Any]) -> None:
        """Move free blocks holding nothing into ``taken`` until it has ``n``, lowest group first."""
        while len(taken) < n and self._open:
            g = self._open[0]
            members = self._free_uncached.get(g)
            if not members:
                heapq.heappop(self._open)
                continue
            while members and len(taken) < n:
                block = self._blocks[members.pop()]
                self.order.unlink(block)
                taken.append(block)
                self._free_uncached_total -= 1

    def take_one_uncached(self) -> Any | None:
        """:meth:`take_uncached` for one block (a load from the host tier, once per block): the block, or None."""
        opened = self._open
        while opened:
            members = self._free_uncached.get(opened[0])
            if not members:
                heapq.heappop(opened)
                continue
            block = self._blocks[members.pop()]
            self.order.unlink(block)
            self._free_uncached_total -= 1
            return block
        return None

    def evict_lru(self, n: int) -> list[Any]:
        """Up to ``n`` cached free blocks, least recently used first, no longer counted as free."""
        evicted: list[Any] = []
        while len(evicted) < n and self._cached:
            _, block = self._cached.popitem(last=False)
            self.cached_count[block.block_id // self._per_group] -= 1
            self.order.unlink(block)
            evicted.append(block)
        return evicted

    def lru_victim(self, protected: set[int]) -> Any | None:
        """The least recently used cached free block not in ``protected``, no longer counted as free."""
        for victim in self._cached.values():  # the least recently used first; few are protected
            if victim.block_id not in protected:
                break
        else:
            return None
        block_id = victim.block_id
        del self._cached[block_id]
        self.cached_count[block_id // self._per_group] -= 1
        self.order.unlink(victim)
        return victim

    def uncache(self, block: Any) -> None:
        """A cached free block loses its prefix: it stays free, holding nothing."""
        del self._cached[block.block_id]
        g = block.block_id // self._per_group
        self.cached_count[g] -= 1
        self._add_uncached(g, block.block_id)

    def drop_hashless(self, block_ids: Iterable[int] | None) -> None:
        """Cached free blocks (of ``block_ids``, or all) whose hash vLLM dropped hold nothing now."""
        ids = list(self._cached) if block_ids is None else [b for b in block_ids if b in self._cached]
        dropped = [self._cached[b] for b in ids if self._cached[b].block_hash is None]
        for block in dropped:
            self.uncache(block)
        self.note_empty({b.block_id // self._per_group for b in dropped})

    def mark_taken(self, blocks: list[Any], now: float | None) -> None:
        """``blocks``, no longer counted as free, are in use (taken at ``now``, if it counts as use)."""
        self.num_in_use += len(blocks)
        for block in blocks:
            self._use(block.block_id // self._per_group, now)

    def mark_one_taken(self, block: Any) -> None:
        """:meth:`mark_taken` of one block, not counted as use (a load's destination, freed again at once)."""
        self.num_in_use += 1
        g = block.block_id // self._per_group
        self.in_use[g] += 1
        self.empty.discard(g)

    def remove(self, block: Any, now: float) -> None:
        """vLLM took this particular free block (a prefix hit, once per block matched): it is in use."""
        block_id = block.block_id
        g = block_id // self._per_group
        if self._cached.pop(block_id, None) is not None:
            self.cached_count[g] -= 1
        else:
            self._free_uncached[g].remove(block_id)
            self._free_uncached_total -= 1
        self.order.unlink(block)
        self.num_in_use += 1
        self._use(g, now)

    def _use(self, g: int, now: float | None) -> None:
        self.in_use[g] += 1
        if now is not None:
            self.last_used[g] = now
        self.empty.discard(g)

    def mark_freed(self, blocks: list[Any], now: float) -> None:
        """``blocks`` were freed at ``now``."""
        touched: set[int] = set()
        for block in blocks:
            g = block.block_id // self._per_group
            self.in_use[g] -= 1
            self.last_used[g] = now
            self._to_free(block, g)
            touched.add(g)
        self.num_in_use -= len(blocks)
        self.note_empty(touched)

    def mark_one_freed(self, block: Any, now: float) -> None:
        """:meth:`mark_freed` of one block (every load from the host tier frees its block again at once)."""
        g = block.block_id // self._per_group
        self.in_use[g] -= 1
        self.last_used[g] = now
        self._to_free(block, g)
        self.num_in_use -= 1
        self.note_empty((g,))

    def to_free(self, block: Any) -> None:
        """Count ``block`` as free: cached if it holds a prefix, else holding nothing."""
        self._to_free(block, block.block_id // self._per_group)

    def _to_free(self, block: Any, g: int) -> None:
        self.order.append(block)
        if block.block_hash is not None:
            self._cached[block.block_id] = block
            self.cached_count[g] += 1
        else:
            self._add_uncached(g, block.block_id)

    def _add_uncached(self, g: int, block_id: int) -> None:
        members = self._free_uncached[g]
        if not members:
            heapq.heappush(self._open, g)
        members.add(block_id)
        self._free_uncached_total += 1
