"""Make one vLLM ``BlockPool`` instance page-aware, without subclassing it.

Only the GPU pool of the scheduler is changed (a CPU offload pool in the same
process keeps vLLM's own queue): its free queue is replaced by
:class:`PageAwareFreeQueue`, and the three methods whose meaning depends on
"free" are wrapped on the instance so vLLM's own checks still hold.
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.errors import PatchError
from kvelastic.integration.elastic_cache import ElasticKVCache
from kvelastic.integration.free_queue import PageAwareFreeQueue
from kvelastic.integration.mapper import GroupMapper


def make_page_aware(block_pool: Any, cache: ElasticKVCache, mapper: GroupMapper | None = None, *,
                    max_ahead_groups: int = 1) -> PageAwareFreeQueue:
    """Swap ``block_pool``'s free queue for a page-aware one over ``cache``; return it."""
    if block_pool.num_gpu_blocks != cache.num_blocks:
        raise PatchError(f"the scheduler's block pool has {block_pool.num_gpu_blocks} blocks but the "
                         f"elastic KV tensors hold {cache.num_blocks}: they were sized from different configs")
    old_queue = block_pool.free_block_queue
    queue = PageAwareFreeQueue(cache, block_pool.blocks, old_queue.get_all_free_blocks(),
                               block_pool._maybe_evict_cached_block, mapper,
                               max_ahead_groups=max_ahead_groups)
    block_pool.free_block_queue = queue
    _wrap_instance(block_pool, "reset_prefix_cache", _reset_prefix_cache)
    _wrap_instance(block_pool, "get_usage", _get_usage)
    if hasattr(block_pool, "evict_blocks"):
        _wrap_instance(block_pool, "evict_blocks", _evict_blocks)
    block_pool.kvelastic_queue = queue
    return queue


def _wrap_instance(obj: Any, name: str, wrapper: Any) -> None:
    original = getattr(obj, name)
    setattr(obj, name, functools.partial(wrapper, obj, original))


def _reset_prefix_cache(pool: Any, original: Any) -> bool:
    """vLLM checks "every block but the null block is free": count unmapped blocks as free."""
    queue: PageAwareFreeQueue = pool.free_block_queue
    queue.report_all_free = True
    try:
        done = original()
    finally:
        queue.report_all_free = False
    if done:
        queue.reclassify()
    return done


def _evict_blocks(pool: Any, original: Any, block_ids: set[int]) -> None:
    original(block_ids)
    pool.free_block_queue.reclassify(block_ids)


def _get_usage(pool: Any, original: Any) -> float:
    """Usage relative to what is physically obtainable, not to the virtual capacity."""
    queue: PageAwareFreeQueue = pool.free_block_queue
    free = queue.num_free_blocks
    used = queue.num_in_use - 1  # the null block is always "in use"
    total = used + free
    return used / total if total else 0.0
