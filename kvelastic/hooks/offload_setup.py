"""Wire the host tier into one engine: views of its blocks, the tier, the copier, the hooks.

Enabled by ``KVELASTIC_CPU_BYTES``. The block pool's prefix-cache lookup is
wrapped on its map instance, through the Patcher, so a GPU miss that the host
tier can serve becomes a GPU hit, and the page-aware queue spills cached
blocks before evicting them. The contacts are declared in
``patches/host_tier_lookup.py``.

The wiring (:func:`wire_offload`) is the same wherever the KV tensors live;
only the tier and its copier differ, and the engine's
:class:`~kvelastic.hooks.connection.CacheConnection` makes them: here
:func:`local_host_tier`, under tensor parallelism an index on the scheduler
and a :class:`BlockRows` copier on each rank. What runs (write-through or
stores at eviction, the side stream, the staging buffers, loads in pieces)
is the engine's :class:`~kvelastic.offload.plan.HostPlan`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable

import torch

from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.scheduler.free_queue import PageAwareFreeQueue
from kvelastic.offload.copier import BlockCopier
from kvelastic.offload.host_memory import HostMemory
from kvelastic.offload.host_tier import HostTier
from kvelastic.offload.manager import OffloadManager
from kvelastic.offload.plan import HostPlan
from kvelastic.offload.store_ahead import AheadCopies
from kvelastic.offload.side_stores import SideStoreCopier
from kvelastic.offload.write_through import WriteThrough, ahead_slots
from kvelastic.patches.host_tier_lookup import CACHE_FULL_BLOCKS, GET_ONE_BLOCK, hash_assigner, named_full
from kvelastic.patching.apply import Change, Patcher
from kvelastic.roles import Copier


def block_views(cache: ElasticKVCache) -> list[torch.Tensor]:
    """One (num_blocks, bytes) int8 view per run of every KV tensor: a block's bytes, row by row."""
    pool = cache.pool
    regions = {r.region_id: r for r in pool.regions}
    views = []
    for runs in cache.layout.regions:
        region = regions[runs.region]
        raw = pool.view_of(region)
        for start, length in runs.runs:
            views.append(torch.as_strided(raw, (cache.num_blocks, length), (runs.block_stride, 1), start))
    return views


class BlockRows:
    """An elastic cache's blocks as rows of bytes: one host slot's width, and copies to slots that wide."""

    def __init__(self, cache: ElasticKVCache):
        self.views = block_views(cache)
        self.slot_bytes = sum(v.shape[1] for v in self.views)
        self.pin = self.views[0].device.type == "cuda"  # pinned host memory serves a GPU's copies only

    def copier(self, memory: HostMemory, *, staged_side_stores: bool = False,
               staged_loads: bool = False) -> BlockCopier:
        """A copier between these rows and ``memory``; ``staged_side_stores`` / ``staged_loads``: the side
        stores / the loads nothing waits for go through staging buffers of their own (:class:`HostPlan`)."""
        return BlockCopier(self.views, memory.buffer, breaks=memory.breaks, staged_side_stores=staged_side_stores,
                           staged_loads=staged_loads)


def local_host_tier(cache: ElasticKVCache, capacity_bytes: int, policy: str,
                    plan: HostPlan) -> tuple[HostTier, BlockCopier]:
    """A tier of ``capacity_bytes`` under ``policy``, pinned in the background, and the copier between it
    and ``cache``'s blocks, as ``plan`` has them."""
    rows = BlockRows(cache)
    slots = capacity_bytes // rows.slot_bytes
    tier = HostTier(capacity_bytes, rows.slot_bytes, pin=rows.pin, policy=policy,
                    ahead_slots=ahead_slots(slots) if plan.write_through else 0)
    assert tier.memory is not None  # a tier that allocates (the default) always has its memory
    return tier, rows.copier(tier.memory, staged_side_stores=plan.stores_beside, staged_loads=plan.staged_loads)


def wire_offload(block_pool: Any, queue: PageAwareFreeQueue, tier: HostTier, copier: Copier,
                 patcher: Patcher, plan: HostPlan | None = None, *, serve_misses: bool = True) -> OffloadManager:
    """The host tier's manager for ``block_pool``, running ``plan`` (None: stores at eviction only, loads
    in one batch): the queue spills through it, prefix misses reload (``serve_misses``; else asynchronous
    loads, ``kvelastic/hooks/host_loads.py``, serve them).

    With write-through the blocks ``cache_full_blocks`` names are stored as
    they are computed (beside the copy stream where the plan and the copier
    allow), and the blocks whose hash vLLM drops outside an eviction lose
    their copies made ahead.
    """
    write_through = None
    if plan is not None and plan.write_through:
        beside = plan.stores_beside and copier.side_stores
        write_through = WriteThrough(AheadCopies(tier), copier.bytes_per_block, beside=beside)
        if beside:
            copier = SideStoreCopier(copier, write_through)
    pieces = plan is not None and plan.load_pieces
    manager = OffloadManager(tier, copier, queue, block_entry(block_pool, patcher), write_through, pieces=pieces)
    queue.spill_hook = manager.spill
    if serve_misses:
        hook_lookup(block_pool, manager, patcher)
    if write_through is not None:
        queue.drop_hook = manager.dropped
        patcher.wrap_instance(block_pool, CACHE_FULL_BLOCKS, functools.partial(_named_full, manager))
    return manager


def _named_full(manager: OffloadManager, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    wrapped(*args, **kwargs)
    manager.computed(named_full(args, kwargs))


def hook_lookup(block_pool: Any, manager: OffloadManager, patcher: Patcher,
                serve_when: Callable[[], bool] | None = None) -> "PrefixLookupHook":
    """Let ``block_pool``'s prefix-cache map fall back to the host tier, now and after every reset;
    with ``serve_when``, only at the lookups where it says so (the others stay misses)."""
    return PrefixLookupHook(block_pool, manager, patcher, serve_when)


def block_entry(block_pool: Any, patcher: Patcher) -> Callable[[Any, Hashable], None]:
    """``enter(block, key)``: ``block`` takes hash ``key`` and enters ``block_pool``'s prefix-cache map."""
    assign = hash_assigner(patcher)

    def enter(block: Any, key: Hashable) -> None:
        assign(block, key)
        block_pool.cached_block_hash_to_block.insert(key, block)

    return enter


class PrefixLookupHook:
    """The host tier's hook on the prefix-cache map's ``get_one_block``, following the map through resets.

    vLLM's ``reset_prefix_cache`` replaces the map with a new one (0.34 clears it
    in place instead); the manager's reset then calls :meth:`install`, which drops
    the hook on the old map and hooks the current one, so the Patcher never holds
    more than one.
    """

    def __init__(self, block_pool: Any, manager: OffloadManager, patcher: Patcher,
                 serve_when: Callable[[], bool] | None = None):
        self._block_pool = block_pool
        self._manager = manager
        self._patcher = patcher
        self._serve_when = serve_when
        self._change: Change | None = None
        self.install()
        manager.on_reset(self.install)

    def install(self) -> None:
        if self._change is not None:
            self._patcher.undo(self._change)
        index = self._block_pool.cached_block_hash_to_block
        self._change = self._patcher.wrap_instance(index, GET_ONE_BLOCK, self._get_one_block)

    def _get_one_block(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        block = wrapped(*args, **kwargs)
        if block is None:
            if self._serve_when is not None and not self._serve_when():
                return None
            return self._manager.load_on_miss(args[0] if args else kwargs["key"])
        self._manager.matched(block)
        return block
