"""A page-aware stand-in for vLLM's free block queue on the GPU block pool.

vLLM's ``BlockPool`` keeps free blocks in one LRU list and hands out the head.
Here free blocks are kept per page group, so that:

- blocks are handed out only from mapped groups, lowest group first, which
  packs live blocks together and leaves high groups empty;
- when mapped groups run out, new groups are mapped (within the pool's limit);
  only when no group can be mapped are cached prefix blocks evicted, in LRU
  order, exactly as vLLM would evict them;
- a group whose blocks are all free and hold no cached prefix is unmapped
  (after the GPU is done with it); groups holding only cached blocks are
  released by :meth:`reclaim_cached` when they idle or memory is needed.

``num_free_blocks`` counts what can really be had: free blocks in mapped
groups plus the groups the pool can still map. vLLM compares it with what a
request needs, so running out of physical memory is a scheduling miss.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

from kvelastic.errors import PoolExhausted
from kvelastic.integration.elastic_cache import NULL_GROUP, ElasticKVCache


class PageAwareFreeQueue:
    """Implements the interface of vLLM's ``FreeKVCacheBlockQueue`` over page groups."""

    def __init__(self, cache: ElasticKVCache, blocks: list[Any], free_blocks: Iterable[Any],
                 evict_cached: Callable[[Any], Any], *, warm_groups: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        self.cache = cache
        self._blocks = blocks
        self._evict_cached = evict_cached
        self._clock = clock
        self.warm_groups = warm_groups
        self.report_all_free = False
        self.last_allocation = clock()
        groups = cache.num_groups
        self._in_use = [len(cache.blocks_of_group(g)) for g in range(groups)]
        self._cached_count = [0] * groups
        self._last_used = [0.0] * groups
        self._free_uncached: dict[int, set[int]] = {}
        self._free_uncached_total = 0
        self._cached: OrderedDict[int, Any] = OrderedDict()
        self._open: list[int] = []
        self._unmapped = [g for g in range(groups) if not cache.pool.is_mapped(g)]
        self._empty: set[int] = set()
        self._mapped_blocks = 0
        for g in range(groups):
            if cache.pool.is_mapped(g):
                self._adopt_group(g, free=False)
        free = list(free_blocks)
        for block in free:
            self._in_use[cache.group_of_block(block.block_id)] -= 1
        used_unmapped = [g for g in self._unmapped if self._in_use[g]]
        if used_unmapped:
            raise AssertionError(f"blocks in use in unmapped groups {used_unmapped[:5]} at install")
        for block in free:
            if cache.pool.is_mapped(cache.group_of_block(block.block_id)):
                self._to_free(block)
        self.num_total = len(blocks)
        self.num_in_use = sum(self._in_use)
        self._release_empty(set(self._free_uncached))  # groups mapped for start-up warm-up

    # ------------------------------------------------------------ vLLM interface
    @property
    def num_free_blocks(self) -> int:
        if self.report_all_free:
            return self.num_total - self.num_in_use
        unmapped_blocks = self.cache.num_blocks - self._mapped_blocks
        mappable = min(unmapped_blocks, self.cache.mappable_groups() * self.cache.blocks_per_group)
        return self._free_uncached_total + len(self._cached) + mappable

    @num_free_blocks.setter
    def num_free_blocks(self, value: int) -> None:
        raise AttributeError("num_free_blocks is derived from the page groups")

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        taken: list[Any] = []
        self._take_uncached(n, taken)
        if len(taken) < n:
            self._map_more(n - len(taken))
            self._take_uncached(n, taken)
        while len(taken) < n and self._cached:
            _, block = self._cached.popitem(last=False)
            self._cached_count[self.cache.group_of_block(block.block_id)] -= 1
            taken.append(block)
        if len(taken) < n:
            for block in taken:
                self._to_free(block)
            raise ValueError(f"Cannot get {n} free blocks from the pool: "
                             f"no physical memory could be mapped for them")
        now = self._clock()
        self.last_allocation = now
        self.num_in_use += n
        for block in taken:
            g = self.cache.group_of_block(block.block_id)
            self._in_use[g] += 1
            self._last_used[g] = now
            self._empty.discard(g)
        return taken

    def remove(self, block: Any) -> None:
        block_id = block.block_id
        g = self.cache.group_of_block(block_id)
        if self._cached.pop(block_id, None) is not None:
            self._cached_count[g] -= 1
        else:
            self._free_uncached[g].remove(block_id)
            self._free_uncached_total -= 1
        self._in_use[g] += 1
        self.num_in_use += 1
        self._last_used[g] = self._clock()
        self._empty.discard(g)

    def append(self, block: Any) -> None:
        self._release([block])

    def append_n(self, blocks: list[Any]) -> None:
        self._release(blocks)

    def prepend_n(self, blocks: list[Any]) -> None:
        self._release(blocks)

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block in eviction order: uncached first, then cached LRU, then unmapped."""
        uncached = [self._blocks[b] for g in sorted(self._free_uncached) for b in sorted(self._free_uncached[g])]
        unmapped = [self._blocks[b] for g in sorted(self._unmapped_set()) for b in self.cache.blocks_of_group(g)]
        return uncached + list(self._cached.values()) + unmapped

    # ------------------------------------------------------------- maintenance
    def reclassify(self, block_ids: Iterable[int] | None = None) -> None:
        """Blocks whose hash vLLM dropped while they were free become plain free blocks."""
        ids = list(self._cached) if block_ids is None else [b for b in block_ids if b in self._cached]
        dropped = [self._cached[b] for b in ids if self._cached[b].block_hash is None]
        for block in dropped:
            del self._cached[block.block_id]
            g = self.cache.group_of_block(block.block_id)
            self._cached_count[g] -= 1
            self._add_uncached(g, block.block_id)
        self._release_empty({self.cache.group_of_block(b.block_id) for b in dropped})

    def reclaim_cached(self, *, idle_before: float | None = None, groups_wanted: int | None = None) -> int:
        """Evict the cached blocks of cache-only groups and unmap them; return groups released.

        Groups idle since before ``idle_before`` go first (oldest first); with
        ``groups_wanted`` set, up to that many are released whatever their age.
        """
        candidates = sorted((self._last_used[g], g) for g in range(len(self._cached_count))
                            if self._cached_count[g] and not self._in_use[g] and g != NULL_GROUP)
        chosen = [g for t, g in candidates if idle_before is not None and t < idle_before]
        if groups_wanted is not None:
            chosen = [g for _, g in candidates][:groups_wanted]
        for g in chosen:
            for block_id in self.cache.blocks_of_group(g):
                block = self._cached.pop(block_id, None)
                if block is not None:
                    self._evict_cached(block)
                    self._add_uncached(g, block_id)
            self._cached_count[g] = 0
        self._release_empty(set(chosen), keep_warm=False)
        return len(chosen)

    def cached_groups(self) -> int:
        return sum(1 for g, n in enumerate(self._cached_count) if n and not self._in_use[g])

    # ----------------------------------------------------------------- helpers
    def _adopt_group(self, g: int, *, free: bool) -> None:
        """Start tracking a newly mapped group; with ``free`` all its blocks are free."""
        self._mapped_blocks += len(self.cache.blocks_of_group(g))
        self._free_uncached[g] = set()
        if free:
            for block_id in self.cache.blocks_of_group(g):
                self._add_uncached(g, block_id)
            self._empty.add(g)

    def _add_uncached(self, g: int, block_id: int) -> None:
        members = self._free_uncached[g]
        if not members:
            heapq.heappush(self._open, g)
        members.add(block_id)
        self._free_uncached_total += 1

    def _to_free(self, block: Any) -> None:
        g = self.cache.group_of_block(block.block_id)
        if block.block_hash is not None:
            self._cached[block.block_id] = block
            self._cached_count[g] += 1
        else:
            self._add_uncached(g, block.block_id)

    def _take_uncached(self, n: int, taken: list[Any]) -> None:
        while len(taken) < n and self._open:
            g = self._open[0]
            members = self._free_uncached.get(g)
            if not members:
                heapq.heappop(self._open)
                continue
            while members and len(taken) < n:
                taken.append(self._blocks[members.pop()])
                self._free_uncached_total -= 1

    def _map_more(self, blocks_short: int) -> None:
        wanted = -(-blocks_short // self.cache.blocks_per_group)
        groups: list[int] = []
        while self._unmapped and len(groups) < wanted:
            g = heapq.heappop(self._unmapped)
            if not self.cache.pool.is_mapped(g):
                groups.append(g)
        try:
            self.cache.map_groups(groups)
            mapped = groups
        except PoolExhausted:
            mapped = []
            for g in groups:
                try:
                    self.cache.map_groups([g])
                except PoolExhausted:
                    break
                mapped.append(g)
        for g in groups[len(mapped):]:
            heapq.heappush(self._unmapped, g)
        for g in mapped:
            self._adopt_group(g, free=True)

    def _release(self, blocks: list[Any]) -> None:
        now = self._clock()
        touched: set[int] = set()
        for block in blocks:
            g = self.cache.group_of_block(block.block_id)
            self._in_use[g] -= 1
            self._last_used[g] = now
            self._to_free(block)
            touched.add(g)
        self.num_in_use -= len(blocks)
        self._release_empty(touched)

    def _release_empty(self, groups: set[int], keep_warm: bool = True) -> None:
        """Unmap groups with no live and no cached block, keeping a few warm for the next burst."""
        for g in groups:
            if g != NULL_GROUP and not self._in_use[g] and not self._cached_count[g]:
                self._empty.add(g)
        warm = self.warm_groups if keep_warm else 0
        if len(self._empty) <= warm:
            return
        release = sorted(self._empty)[warm:] if warm else sorted(self._empty)
        self._empty.difference_update(release)
        for g in release:
            members = self._free_uncached.pop(g)
            self._free_uncached_total -= len(members)
            self._mapped_blocks -= len(self.cache.blocks_of_group(g))
            heapq.heappush(self._unmapped, g)
        self.cache.unmap_groups(release)

    def _unmapped_set(self) -> set[int]:
        return {g for g in self._unmapped if g not in self._free_uncached}
