"""Wire the host tier into one engine: views of its blocks, the tier, the copier, the hooks.

Enabled by ``KVELASTIC_CPU_BYTES``. The block pool's prefix-cache lookup is
wrapped on the instance so a GPU miss that the host tier can serve becomes a
GPU hit, and the page-aware queue spills cached blocks before evicting them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvelastic.integration.elastic_cache import ElasticKVCache
from kvelastic.integration.free_queue import PageAwareFreeQueue
from kvelastic.offload.copier import DEFAULT_PATH, BlockCopier, CopyPath
from kvelastic.offload.host_tier import HostTier
from kvelastic.offload.manager import OffloadManager


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


def attach_offload(block_pool: Any, queue: PageAwareFreeQueue, cache: ElasticKVCache,
                   cpu_bytes: int, policy: str = "arc", copy_path: CopyPath = DEFAULT_PATH) -> OffloadManager:
    views = block_views(cache)
    slot_bytes = sum(v.shape[1] for v in views)
    pin = views[0].device.type == "cuda"
    tier = HostTier(cpu_bytes, slot_bytes, pin=pin, policy=policy)
    manager = OffloadManager(tier, BlockCopier(views, tier.buffer, path=copy_path), queue, block_pool)
    queue.spill_hook = manager.spill
    hook_lookup(block_pool, manager)
    return manager


def hook_lookup(block_pool: Any, manager: OffloadManager) -> None:
    """Let the prefix-cache map fall back to the host tier (again after a reset replaces it)."""
    index = block_pool.cached_block_hash_to_block
    original = index.get_one_block

    @functools.wraps(original)
    def get_one_block(key: Any) -> Any:
        block = original(key)
        if block is None:
            return manager.load_on_miss(key)
        manager.matched(block)
        return block

    index.get_one_block = get_one_block
