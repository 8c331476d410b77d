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
request needs, so running out of physical memory is a scheduling miss. The
counts per group live in :class:`~kvelastic.scheduler.free_ledger.FreeBlockLedger`;
this module makes the decisions.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Iterator

from kvelastic.scheduler.allocation_hold import AllocationHold
from kvelastic.scheduler.free_ledger import FreeBlockLedger
from kvelastic.scheduler.map_room import MapRoom
from kvelastic.scheduler.prefetch import BurstPrefetch
from kvelastic.roles import Mapper, SchedulerCache

log = logging.getLogger("vllm.kvelastic")


class PageAwareFreeQueue:
    """Implements the interface of vLLM's ``FreeKVCacheBlockQueue`` over page groups."""

    def __init__(self, cache: SchedulerCache, blocks: list[Any], free_blocks: Iterable[Any],
                 evict_cached: Callable[[Any], Any], mapper: Mapper, *,
                 max_ahead_groups: int = 1, keep_free_order: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        """``keep_free_order``: keep vLLM's free-queue order for a connector that walks it (see free_order)."""
        self.cache = cache
        self.mapper = mapper
        self._evict_cached = evict_cached
        self._clock = clock
        self.prefetch = BurstPrefetch(cache.blocks_per_group, max_ahead_groups)
        self.demand_groups = 0  # empty groups the waiting requests need (see want_blocks)
        self.report_all_free = False
        self.spill_hook: Callable[..., Any] | None = None  # set when a host tier exists
        self.drop_hook: Callable[[list[int]], Any] | None = None  # set with write-through: hashes dropped
        self.transfers_in_flight: Callable[[], bool] | None = None  # set for a connector freeing blocks mid-copy
        self.hold = AllocationHold()  # set by the commit guard between vLLM's estimate and allocation
        self.refused_groups = 0
        self.excess_blocks = 0  # blocks the pool holds over its limit, kept out of the free count (shrink_by)
        self.last_allocation = clock()
        self.free = FreeBlockLedger(cache, blocks, free_blocks, cache.pool.is_mapped, keep_order=keep_free_order)
        self._requested: set[int] = set()
        self.room = MapRoom(cache, self.free, self.hold, mapper, clock)  # what could still be mapped
        self.num_total = len(blocks)
        self._balance()

    @property
    def num_in_use(self) -> int:
        return self.free.num_in_use

    # ------------------------------------------------------------ vLLM interface
    @property
    def num_free_blocks(self) -> int:
        if self.report_all_free:
            return self.num_total - self.free.num_in_use
        if self._requested:  # only a group asked for comes back mapped or refused: else no mapper call
            self._adopt_mapped()
        return max(0, self.free.free_in_mapped + self.room.blocks() - self.excess_blocks)

    @num_free_blocks.setter
    def num_free_blocks(self, value: int) -> None:
        raise AttributeError("num_free_blocks is derived from the page groups")

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        self._adopt_mapped()
        taken: list[Any] = []
        self.free.take_uncached(n, taken)
        if len(taken) < n:
            self._map_now(n - len(taken))
            self.free.take_uncached(n, taken)
        evicted = self.free.evict_lru(n - len(taken))
        if evicted and self.spill_hook is not None and len(taken) + len(evicted) == n:
            self.spill_hook(evicted, before_reuse=True)
        taken.extend(evicted)
        if len(taken) < n:
            self._overcommit(n - len(taken), taken)
        if len(taken) < n:
            for block in taken:
                self.free.to_free(block)
            raise ValueError(f"Cannot get {n} free blocks from the pool: "
                             f"no physical memory could be mapped for them")
        now = self._clock()
        self.last_allocation = now
        self.hold.taken(n)
        self.free.mark_taken(taken, now)
        self.prefetch.note(now, n)
        self._balance_within_step()
        return taken

    def _overcommit(self, blocks_short: int, taken: list[Any]) -> None:
        """vLLM counted on blocks our estimate promised but the limit or budget now refuses.

        Going over the (soft) limit keeps the scheduler's decision valid; the
        reclaimer brings the pool back under it. Only the device saying no
        turns this into an error.
        """
        groups = self.free.pop_unmapped(-(-blocks_short // self.cache.blocks_per_group), self._requested)
        self._requested.update(groups)
        self.mapper.map_now(groups, force=True)
        self._adopt_mapped()
        before = len(taken)
        self.free.take_uncached(len(taken) + blocks_short, taken)
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
        mapper, free = self.mapper, self.free
        if mapper.mapped or mapper.refused:
            self._adopt_mapped()
        block = free.take_one_uncached()
        if block is None and self._map_now(1):
            block = free.take_one_uncached()
        if block is None:
            block = free.lru_victim(protected)
            if block is None:
                return None
            if self.spill_hook is not None:
                self.spill_hook([block], before_reuse=True)
            self._evict_cached(block)
        free.mark_one_taken(block)
        return block

    def remove(self, block: Any) -> None:
        self.free.remove(block, self._clock())

    def append(self, block: Any) -> None:
        """One block is free again (every load from the host tier ends here: :meth:`_release` for one)."""
        self.free.mark_one_freed(block, self._clock())
        if self.transfers_in_flight is not None and self.transfers_in_flight():
            self.free.held.add(self.cache.group_of_block(block.block_id))
        self._balance_within_step()

    def append_n(self, blocks: list[Any]) -> None:
        self._release(blocks)

    def prepend_n(self, blocks: list[Any]) -> None:
        self._release(blocks, first=True)

    # ------------------------------------------- what a connector's own walk of the queue reads
    @property
    def fake_free_list_head(self) -> Any:
        """The front end of the free blocks of mapped groups, in vLLM's order (lazy offload, up to 0.25)."""
        return self.free.order.head

    @property
    def fake_free_list_tail(self) -> Any:
        return self.free.order.tail

    def iter_blocks_after(self, cursor: Any | None) -> Iterator[Any]:
        """The free blocks of mapped groups after ``cursor``, least recently freed first (from 0.26)."""
        return self.free.order.after(cursor)

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block in eviction order: uncached first, then cached LRU, then unmapped."""
        return self.free.all_free_blocks()

    # ------------------------------------------------------------- maintenance
    def reclassify(self, block_ids: Iterable[int] | None = None) -> None:
        """Blocks whose hash vLLM dropped while they were free become plain free blocks."""
        if block_ids is not None:
            block_ids = list(block_ids)
            if self.drop_hook is not None:
                self.drop_hook(block_ids)
        self.free.drop_hashless(block_ids)
        self._balance()

    def reclaim_cached(self, *, idle_before: float | None = None, groups_wanted: int | None = None) -> int:
        """Evict the cached blocks of cache-only groups and unmap them; return groups released.

        Groups idle since before ``idle_before`` go first (oldest first); with
        ``groups_wanted`` set, up to that many are released whatever their age.
        """
        self._lift_holds()
        candidates = self.free.cache_only_groups()
        chosen = [g for t, g in candidates if idle_before is not None and t < idle_before]
        if groups_wanted is not None:
            chosen = [g for _, g in candidates][:groups_wanted]
        leaving = self.free.cached_blocks_in(chosen)
        fence = self.spill_hook(leaving, before_reuse=False) if self.spill_hook and leaving else None
        for block in leaving:
            self.free.uncache(block)
            self._evict_cached(block)
        self.free.note_empty(set(chosen))
        self._release_groups(chosen, after=fence)
        return len(chosen)

    def shrink_by(self, groups: int) -> None:
        """The pool holds ``groups`` over its (lowered) limit in groups its running requests use.

        Their blocks are kept out of the free count until that much is free
        again, so vLLM admits nothing new and preempts running requests that do
        not fit, as it would in a cache of the smaller size; the reclaimer then
        releases the groups they leave. 0 lifts it.
        """
        self.excess_blocks = groups * self.cache.blocks_per_group

    def set_idle(self) -> None:
        """No allocation lately: keep no empty group mapped ahead."""
        self.prefetch.clear()
        self.demand_groups = 0
        self._balance()

    def want_blocks(self, blocks: int) -> None:
        """The scheduler's requests need ``blocks`` more soon: keep enough empty groups mapped for them.

        Used where mapping is asynchronous (ranks in other processes): the
        demand holds until the next call replaces it, so groups mapped for
        waiting requests are not released as surplus before they are used,
        also once the free blocks cover the demand (empty groups count only
        for what the partly used groups cannot hold).
        """
        per_group = self.cache.blocks_per_group
        in_used_groups = max(0, self.mapped_free_blocks() - len(self.free.empty) * per_group)
        self.demand_groups = -(-max(0, blocks - in_used_groups) // per_group)  # empty groups to keep or map
        self._balance()

    def map_for(self, blocks: int) -> bool:
        """Map now the groups that ``blocks`` more would need beyond the free mapped blocks.

        Only when the estimate says they can be had (otherwise vLLM's own
        check declines). False if a map was refused and the blocks are not all
        mapped: the estimate was wrong. A refusal of a group requested ahead
        (the wait covers the worker's earlier commands) that leaves these
        blocks mapped is no miss of this allocation.
        """
        short = blocks - self.mapped_free_blocks()
        if short <= 0:
            return True
        mappable = self.room.blocks()
        if short > mappable:  # vLLM will decline: the request waits
            self._report_missing(short - mappable)
            return True
        refused = self.refused_groups
        self._map_now(short)
        if self.refused_groups == refused:
            return True
        self.cache.forget_device_free()  # whoever refused, the next estimate reads the device afresh
        return self.mapped_free_blocks() >= blocks

    def note_shortfall(self, blocks: int) -> None:
        """A request needs ``blocks`` free blocks; if the pool cannot have them, say what it waits for.

        The budget outside this process (the GPU's shared account) learns of
        the wait from here: vLLM declines the request without asking for any
        page, so no refusal would tell it.
        """
        if self.cache.external_want is not None:
            self._report_missing(blocks - self.mapped_free_blocks() - self.room.blocks())

    def _report_missing(self, missing: int) -> None:
        """Tell the outside budget that ``missing`` blocks are wanted (as whole groups), where it can help."""
        want = self.cache.external_want
        if want is not None and missing > 0 and self.mapper.synchronous:
            want(-(-missing // self.cache.blocks_per_group) * self.cache.group_bytes)

    def cached_groups(self) -> int:
        return self.free.cached_groups()

    def mapped_free_blocks(self) -> int:
        """Free blocks in mapped groups, counting groups the mapper has mapped since the last call."""
        self._adopt_mapped()
        return self.free.free_in_mapped

    # ----------------------------------------------------------------- helpers
    def _room_to_request(self) -> int:
        """Groups the prefetch may still ask for: the pool's room less what is asked for already.

        Where the pool takes a group's pages only once the worker maps it, the
        groups requested ahead and not mapped yet are still in the room: asking
        for the room again on top of them had the worker map past the limit
        near it, and the refusal reached the commit guard inside the next
        allocation's wait as if the device had refused that allocation (1B
        multi-turn on an H100, ``KVELASTIC_LIMIT=2GiB``, 2026-11-28).
        """
        groups = self.room.groups()
        if not self.mapper.requests_hold_room:
            groups -= len(self._requested)
        return max(0, groups)

    def _adopt_mapped(self) -> None:
        mapper = self.mapper
        while mapper.mapped:
            g = mapper.mapped.popleft()
            self._requested.discard(g)
            self.free.adopt_group(g, free=True)
            self.room.forget()
        while mapper.refused:
            g = mapper.refused.popleft()
            self._requested.discard(g)
            self.refused_groups += 1
            self.free.return_unmapped(g)
            self.room.forget()

    def _map_now(self, blocks_short: int) -> bool:
        """A burst outran the prefetch: wait for the groups already requested, map what is still missing.
        False if it waited for and mapped nothing (no free block can have come)."""
        if not self.mapper.synchronous:
            return False  # ranks in other processes confirm groups a step later: nothing to wait for here
        if not self.room.blocks() and not self._requested:
            return False  # the pool can map nothing now: do not wait on the worker for a refusal
        wanted = -(-blocks_short // self.cache.blocks_per_group) - len(self._requested)
        groups = self.free.pop_unmapped(wanted, self._requested) if wanted > 0 else []
        self._requested.update(groups)
        self.mapper.map_now(groups)  # commands run in order: the earlier requests are done too
        self._adopt_mapped()
        return True

    def _release(self, blocks: list[Any], *, first: bool = False) -> None:
        """``blocks`` are free again: last in vLLM's order, or (``first``) at its front."""
        self.free.mark_freed(blocks, self._clock())
        if first:
            self.free.order.move_to_head(blocks)
        if self.transfers_in_flight is not None and blocks and self.transfers_in_flight():
            self.free.held.update(self.cache.group_of_block(b.block_id) for b in blocks)
        self._balance_within_step()

    def _lift_holds(self) -> None:
        """Groups held for a connector's copies may go once it has nothing in flight."""
        if self.free.held and not (self.transfers_in_flight is not None and self.transfers_in_flight()):
            self.free.note_empty(self.free.held)
            self.free.held.clear()

    def _balance_within_step(self) -> None:
        """After an allocation or a free: balance now where mapping is synchronous; else the step's end
        does, with that step's demand (see :meth:`_balance`)."""
        if self.mapper.synchronous:
            self._balance()

    def _balance(self) -> None:
        """Keep the prefetch's empty groups mapped: request more, or release the surplus.

        Where mapping is asynchronous, allocations and frees within a step do not
        balance: the demand they would weigh against is the last step's, so a group
        given back there is asked for again a step later and one asked for is soon
        surplus (each cycle a driver call before a forward pass and a step of
        confirmation lag on every rank); the step's end (:meth:`want_blocks`)
        decides with the demand of now. Runs after every free, so once per block loaded from the host
        tier: the calls that find nothing to do are skipped by their own first test."""
        free, mapper = self.free, self.mapper
        if mapper.mapped or mapper.refused:
            self._adopt_mapped()
        if free.held:
            self._lift_holds()
        want = max(self.prefetch.groups, self.demand_groups)
        empty = free.empty
        have = len(empty) + len(self._requested)
        if have < want:
            count = min(want - have, self._room_to_request())  # at the limit: 0, once per free
            groups = free.pop_unmapped(count, self._requested) if count > 0 else []
            if groups:
                self._requested.update(groups)
                mapper.request_map(groups)
        elif len(empty) > want and not self.hold.secured:
            releasable = sorted(empty - free.held)
            self._release_groups(releasable[max(0, want - (len(empty) - len(releasable))):])

    def _release_groups(self, groups: list[int], after: Any = None) -> None:
        """Stop using empty groups and have the worker unmap them once the GPU (and ``after``) is done."""
        groups = self.free.release_empty(groups)
        if not groups:
            return
        self.room.forget()
        self.mapper.request_unmap(groups, after=after)
