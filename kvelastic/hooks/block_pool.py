"""Make one vLLM ``BlockPool`` instance page-aware, without subclassing it.

Only the GPU pool of the scheduler is changed (a CPU offload pool in the same
process keeps vLLM's own queue): its free queue is replaced by
:class:`PageAwareFreeQueue`, and the methods whose meaning depends on "free"
are wrapped on the instance so vLLM's own checks still hold. Every change goes
through the Patcher, on the contacts ``patches/block_pool_queue.py`` declares.
"""

from __future__ import annotations

from typing import Any

from kvelastic.errors import PatchError
from kvelastic.scheduler.free_queue import PageAwareFreeQueue
from kvelastic.patches.block_pool_queue import BLOCK_POOL, EVICT_BLOCKS, GET_USAGE, RESET_PREFIX_CACHE
from kvelastic.patching.apply import Patcher
from kvelastic.roles import Mapper, SchedulerCache


def make_page_aware(block_pool: Any, cache: SchedulerCache, mapper: Mapper, *,
                    patcher: Patcher, max_ahead_groups: int = 1, keep_free_order: bool = True) -> PageAwareFreeQueue:
    """Swap ``block_pool``'s free queue for a page-aware one over ``cache``, mapped by ``mapper``; return it.

    ``keep_free_order``: the queue also keeps vLLM's free-queue order, which only a connector walks.
    """
    if block_pool.num_gpu_blocks != cache.num_blocks:
        raise PatchError(f"the scheduler's block pool has {block_pool.num_gpu_blocks} blocks but the "
                         f"elastic KV tensors hold {cache.num_blocks}: they were sized from different configs")
    queue = PageAwareFreeQueue(cache, block_pool.blocks, block_pool.free_block_queue.get_all_free_blocks(),
                               block_pool._maybe_evict_cached_block, mapper,
                               max_ahead_groups=max_ahead_groups, keep_free_order=keep_free_order)
    patcher.replace_attribute(block_pool, BLOCK_POOL, "free_block_queue", queue)
    patcher.wrap_instance(block_pool, RESET_PREFIX_CACHE, _reset_prefix_cache)
    patcher.wrap_instance(block_pool, GET_USAGE, _get_usage)
    if patcher.declares(EVICT_BLOCKS):  # from 0.13
        patcher.wrap_instance(block_pool, EVICT_BLOCKS, _evict_blocks)
    patcher.add_attribute(block_pool, "kvelastic_queue", queue)
    return queue


def _reset_prefix_cache(wrapped: Any, pool: Any, args: tuple, kwargs: dict) -> bool:
    """vLLM checks "every block but the null block is free": count unmapped blocks as free."""
    queue: PageAwareFreeQueue = pool.free_block_queue
    queue.report_all_free = True
    try:
        done = wrapped(*args, **kwargs)
    finally:
        queue.report_all_free = False
    if done:
        queue.reclassify()
    return done


def _evict_blocks(wrapped: Any, pool: Any, args: tuple, kwargs: dict) -> None:
    wrapped(*args, **kwargs)
    pool.free_block_queue.reclassify(args[0] if args else kwargs["block_ids"])


def _get_usage(wrapped: Any, pool: Any, args: tuple, kwargs: dict) -> float:
    """Usage relative to what is physically obtainable, not to the virtual capacity."""
    queue: PageAwareFreeQueue = pool.free_block_queue
    free = queue.num_free_blocks
    used = queue.num_in_use - 1  # the null block is always "in use"
    total = used + free
    return used / total if total else 0.0
