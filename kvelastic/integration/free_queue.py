"""A page-aware stand-in for vLLM's free block queue on the GPU block pool.

vLLM's ``BlockPool`` keeps free blocks in one LRU list and hands out the head.
Here free blocks are kept per page group, so that:

- blocks are handed out only from mapped groups, lowest group first, which
  packs live blocks together and leaves high groups empty;
- a few empty groups are kept mapped ahead of need (as many as recent
  allocation bursts used), mapped and unmapped by a worker thread so the
  scheduler rarely waits on the driver;
- when mapped groups run out, more are mapped (within the pool's limit); only
  when none can be mapped are cached prefix blocks evicted, in LRU order,
  exactly as vLLM would evict them;
- groups holding only cached blocks are released by :meth:`reclaim_cached`
  when they idle past the TTL or when memory is needed.

``num_free_blocks`` counts what can really be had: free blocks in mapped
groups plus the groups the pool can still map. vLLM compares it with what a
request needs, so running out of physical memory is a scheduling miss.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

from kvelastic.integration.commit_guard import AllocationHold
from kvelastic.integration.elastic_cache import NULL_GROUP, ElasticKVCache
from kvelastic.integration.mapper import GroupMapper
from kvelastic.integration.prefetch import BurstPrefetch

log = logging.getLogger("vllm.kvelastic")

MAPPABLE_TTL_S = 0.001


class PageAwareFreeQueue:
    """Implements the interface of vLLM's ``FreeKVCacheBlockQueue`` over page groups."""

    def __init__(self, cache: ElasticKVCache, blocks: list[Any], free_blocks: Iterable[Any],
                 evict_cached: Callable[[Any], Any], mapper: GroupMapper | None = None, *,
                 max_ahead_groups: int = 1, clock: Callable[[], float] = time.monotonic):
        self.cache = cache
        self.mapper = mapper or GroupMapper(cache)
        self._blocks = blocks
        self._evict_cached = evict_cached
        self._clock = clock
        self.prefetch = BurstPrefetch(cache.blocks_per_group, max_ahead_groups)
        self.demand_groups = 0  # empty groups the waiting requests need (see want_blocks)
        self.report_all_free = False
        self.spill_hook: Callable[..., Any] | None = None  # set when a host tier exists
        self.hold = AllocationHold()  # set by the commit guard between vLLM's estimate and allocation
        self.refused_groups = 0
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
        self._requested: set[int] = set()
        self._empty: set[int] = set()
        self._mapped_blocks = 0
        self._mappable_until = 0.0
        self._mappable_value = 0
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
        self._note_empty(set(self._free_uncached))  # groups mapped for start-up warm-up
        self._balance()

    # ------------------------------------------------------------ vLLM interface
    @property
    def num_free_blocks(self) -> int:
        if self.report_all_free:
            return self.num_total - self.num_in_use
        if self.mapper.mapped or self.mapper.refused:
            self._adopt_mapped()
        return self._free_uncached_total + len(self._cached) + self._mappable_blocks()

    @num_free_blocks.setter
    def num_free_blocks(self, value: int) -> None:
        raise AttributeError("num_free_blocks is derived from the page groups")

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        self._adopt_mapped()
        taken: list[Any] = []
        self._take_uncached(n, taken)
        if len(taken) < n:
            self._map_now(n - len(taken))
            self._take_uncached(n, taken)
        evicted: list[Any] = []
        while len(taken) + len(evicted) < n and self._cached:
            _, block = self._cached.popitem(last=False)
            self._cached_count[self.cache.group_of_block(block.block_id)] -= 1
            evicted.append(block)
        if evicted and self.spill_hook is not None and len(taken) + len(evicted) == n:
            self.spill_hook(evicted, before_reuse=True)
        taken.extend(evicted)
        if len(taken) < n:
            self._overcommit(n - len(taken), taken)
        if len(taken) < n:
            for block in taken:
                self._to_free(block)
            raise ValueError(f"Cannot get {n} free blocks from the pool: "
                             f"no physical memory could be mapped for them")
        now = self._clock()
        self.last_allocation = now
        self.hold.taken(n)
        self.num_in_use += n
        for block in taken:
            g = self.cache.group_of_block(block.block_id)
            self._in_use[g] += 1
            self._last_used[g] = now
            self._empty.discard(g)
        self.prefetch.note(now, n)
        self._balance()
        return taken

    def _overcommit(self, blocks_short: int, taken: list[Any]) -> None:
        """vLLM counted on blocks our estimate promised but the limit or budget now refuses.

        Going over the (soft) limit keeps the scheduler's decision valid; the
        reclaimer brings the pool back under it. Only the device saying no
        turns this into an error.
        """
        groups = self._pop_unmapped(-(-blocks_short // self.cache.blocks_per_group))
        self._requested.update(groups)
        self.mapper.map_now(groups, force=True)
        self._adopt_mapped()
        before = len(taken)
        self._take_uncached(len(taken) + blocks_short, taken)
        if len(taken) > before:
            log.warning("kvelastic: mapped %d blocks past the limit to honour a scheduling decision made "
                        "on a stale estimate; the reclaimer will return them", len(taken) - before)

    def take_block_for_load(self, protected: set[int]) -> Any | None:
        """One free block to load a host-tier block into, or None.

        Prefers blocks holding no cached prefix (mapping a group if needed);
        otherwise evicts the least recently used cached block, spilling it
        first, but never one in ``protected``: the scheduler may have matched
        those for the very request whose prefix is being loaded.
        """
        self._adopt_mapped()
        taken: list[Any] = []
        self._take_uncached(1, taken)
        if not taken:
            self._map_now(1)
            self._take_uncached(1, taken)
        if not taken:
            victim = next((b for b in self._cached.values() if b.block_id not in protected), None)
            if victim is None:
                return None
            del self._cached[victim.block_id]
            self._cached_count[self.cache.group_of_block(victim.block_id)] -= 1
            if self.spill_hook is not None:
                self.spill_hook([victim], before_reuse=True)
            self._evict_cached(victim)
            taken.append(victim)
        block = taken[0]
        g = self.cache.group_of_block(block.block_id)
        self._in_use[g] += 1
        self.num_in_use += 1
        self._empty.discard(g)
        return block

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
        unmapped = [self._blocks[b] for g in range(self.cache.num_groups) if g not in self._free_uncached
                    for b in self.cache.blocks_of_group(g)]
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
        self._note_empty({self.cache.group_of_block(b.block_id) for b in dropped})
        self._balance()

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
        leaving = [self._cached[b] for g in chosen for b in self.cache.blocks_of_group(g) if b in self._cached]
        fence = self.spill_hook(leaving, before_reuse=False) if self.spill_hook and leaving else None
        for block in leaving:
            del self._cached[block.block_id]
            self._evict_cached(block)
            self._add_uncached(self.cache.group_of_block(block.block_id), block.block_id)
        for g in chosen:
            self._cached_count[g] = 0
        self._note_empty(set(chosen))
        self._release_groups(chosen, after=fence)
        return len(chosen)

    def set_idle(self) -> None:
        """No allocation lately: keep no empty group mapped ahead."""
        self.prefetch.clear()
        self.demand_groups = 0
        self._balance()

    def want_blocks(self, blocks: int) -> None:
        """The scheduler's requests need ``blocks`` more soon: keep enough empty groups mapped for them.

        Used where mapping is asynchronous (ranks in other processes): the
        demand holds until the next call replaces it, so groups mapped for
        waiting requests are not released as surplus before they are used.
        """
        self._adopt_mapped()
        short = max(0, blocks - self._free_uncached_total - len(self._cached))
        self.demand_groups = len(self._empty) + -(-short // self.cache.blocks_per_group) if short else 0
        self._balance()

    def map_for(self, blocks: int) -> bool:
        """Map now the groups that ``blocks`` more would need beyond the free mapped blocks.

        Only when the estimate says they can be had (otherwise vLLM's own
        check declines). False if a map was refused: the estimate was wrong.
        """
        self._adopt_mapped()
        short = blocks - self._free_uncached_total - len(self._cached)
        if short <= 0 or short > self._mappable_blocks():
            return True
        refused = self.refused_groups
        self._map_now(short)
        return self.refused_groups == refused

    def cached_groups(self) -> int:
        return sum(1 for g, n in enumerate(self._cached_count) if n and not self._in_use[g])

    # ----------------------------------------------------------------- helpers
    def _mappable_blocks(self) -> int:
        """Blocks in groups the pool could still map; recomputed at most every millisecond.

        Zero when mapping is not synchronous (ranks in other processes must
        confirm a group first): blocks are promised only once really mapped;
        zero too for the rest of a step in which the device refused a map.
        """
        if not getattr(self.mapper, "synchronous", True) or self.hold.refused:
            return 0
        now = self._clock()
        if now < self._mappable_until:
            return self._mappable_value
        unmapped_blocks = self.cache.num_blocks - self._mapped_blocks
        groups = self.cache.mappable_groups(self.cache.num_groups - len(self._free_uncached))
        self._mappable_value = min(unmapped_blocks, groups * self.cache.blocks_per_group)
        self._mappable_until = now + MAPPABLE_TTL_S
        return self._mappable_value

    def _forget_mappable(self) -> None:
        self._mappable_until = 0.0

    def _adopt_group(self, g: int, *, free: bool) -> None:
        """Start tracking a newly mapped group; with ``free`` all its blocks are free."""
        self._mapped_blocks += len(self.cache.blocks_of_group(g))
        self._forget_mappable()
        self._free_uncached[g] = set()
        if free:
            for block_id in self.cache.blocks_of_group(g):
                self._add_uncached(g, block_id)
            self._empty.add(g)

    def _adopt_mapped(self) -> None:
        mapper = self.mapper
        while mapper.mapped:
            g = mapper.mapped.popleft()
            self._requested.discard(g)
            self._adopt_group(g, free=True)
        while mapper.refused:
            g = mapper.refused.popleft()
            self._requested.discard(g)
            self.refused_groups += 1
            heapq.heappush(self._unmapped, g)

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

    def _pop_unmapped(self, count: int) -> list[int]:
        groups: list[int] = []
        while self._unmapped and len(groups) < count:
            g = heapq.heappop(self._unmapped)
            if g not in self._free_uncached and g not in self._requested:
                groups.append(g)
        return groups

    def _map_now(self, blocks_short: int) -> None:
        """A burst outran the prefetch: wait for the groups already requested, map what is still missing."""
        if not getattr(self.mapper, "synchronous", True):
            return  # ranks in other processes confirm groups a step later: nothing to wait for here
        if not self._mappable_blocks() and not self._requested:
            return  # the pool can map nothing now: do not wait on the worker for a refusal
        wanted = -(-blocks_short // self.cache.blocks_per_group) - len(self._requested)
        groups = self._pop_unmapped(wanted) if wanted > 0 else []
        self._requested.update(groups)
        self.mapper.map_now(groups)  # commands run in order: the earlier requests are done too
        self._adopt_mapped()

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
        self._note_empty(touched)
        self._balance()

    def _note_empty(self, groups: set[int]) -> None:
        for g in groups:
            if g != NULL_GROUP and g in self._free_uncached and not self._in_use[g] \
                    and not self._cached_count[g]:
                self._empty.add(g)

    def _balance(self) -> None:
        """Keep the prefetch's empty groups mapped: request more, or release the surplus."""
        self._adopt_mapped()
        want = max(self.prefetch.groups, self.demand_groups)
        have = len(self._empty) + len(self._requested)
        if have < want:
            room = self.cache.mappable_groups(self.cache.num_groups - len(self._free_uncached))
            groups = self._pop_unmapped(min(want - have, room))
            if groups:
                self._requested.update(groups)
                self.mapper.request_map(groups)
        elif len(self._empty) > want and not self.hold.secured:
            self._release_groups(sorted(self._empty)[want:] if want else sorted(self._empty))

    def _release_groups(self, groups: list[int], after: Any = None) -> None:
        """Stop using empty groups and have the worker unmap them once the GPU (and ``after``) is done."""
        groups = [g for g in groups if g in self._empty]
        if not groups:
            return
        self._empty.difference_update(groups)
        for g in groups:
            members = self._free_uncached.pop(g)
            self._free_uncached_total -= len(members)
            self._mapped_blocks -= len(self.cache.blocks_of_group(g))
            heapq.heappush(self._unmapped, g)
        self._forget_mappable()
        self.mapper.request_unmap(groups, after=after)
