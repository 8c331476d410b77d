"""The scheduler's view of a KV cache whose tensors live on other processes' GPUs.

It offers what the page-aware queue and the reclaimer use of an
:class:`~kvelastic.integration.elastic_cache.ElasticKVCache` (the block-to-group
layout, bytes per group, how many more groups could be mapped) and a
:class:`ShardedPoolView` in place of the pool: accounting, not memory. Bytes
are per rank: every rank maps the same groups, and vLLM profiled the limit per
GPU.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvelastic.integration.elastic_cache import DEVICE_MARGIN_BYTES, GroupedBlocks, groups_within
from kvelastic.pool.stats import PoolStats
from kvelastic.tp.board import RankInfo
from kvelastic.tp.remote_mapper import RemoteMapper


class ShardedPoolView:
    """Pool-shaped accounting over the groups the scheduler has mapped on every rank."""

    def __init__(self, mapper: RemoteMapper, info: RankInfo, limit_bytes: int | None):
        self.mapper = mapper
        self.page_bytes = info.page_bytes
        self.group_bytes = info.group_bytes
        self.num_groups = info.layout.num_groups
        self.limit_bytes = limit_bytes
        self.lock: Any = None  # the scheduler's lock, set at attach
        self.reserve_pages = 0  # the warm reserve every rank was last told to keep

    def is_mapped(self, group: int) -> bool:
        return group in self.mapper.mapped_groups

    def held_bytes(self) -> int:
        return (len(self.mapper.mapped_groups) + self.mapper.pending_groups) * self.group_bytes

    def headroom_estimate(self, device_free: int | None) -> int | None:
        room = None if self.limit_bytes is None else max(0, self.limit_bytes - self.held_bytes())
        if device_free is not None:
            room = device_free if room is None else min(room, device_free)
        return room

    def stats(self) -> PoolStats:
        mapped = len(self.mapper.mapped_groups) * self.group_bytes
        return PoolStats(page_bytes=self.page_bytes, virtual_bytes=self.num_groups * self.group_bytes,
                         mapped_bytes=mapped, pending_unmap_bytes=0, reserve_bytes=self.reserve_pages * self.page_bytes,
                         held_bytes=self.held_bytes(), limit_bytes=self.limit_bytes,
                         groups_mapped=len(self.mapper.mapped_groups), num_groups=self.num_groups,
                         pages_created=0, reserve_hits=0, reserve_misses=0)

    def collect(self, wait: bool = False) -> int:
        """The reclaimer's periodic call: commands queued while idle go out now."""
        if self.lock is None:
            self.mapper.deliver_idle()
            return 0
        with self.lock:
            self.mapper.deliver_idle()
        return 0

    def grow_reserve(self, pages: int) -> int:
        """The reclaimer's warm reserve, kept by every rank: a command, sent when the target changes."""
        return self._set_reserve(self.reserve_pages + max(0, pages))

    def trim_reserve(self, keep_pages: int = 0) -> int:
        return self._set_reserve(min(self.reserve_pages, keep_pages))

    def _set_reserve(self, pages: int) -> int:
        if pages == self.reserve_pages:
            return 0
        change, self.reserve_pages = pages - self.reserve_pages, pages
        self.mapper.request_reserve(pages)
        return abs(change)


class ShardedKVCache(GroupedBlocks):
    """Layout and capacity of the KV cache every rank holds a shard of."""

    def __init__(self, mapper: RemoteMapper, infos: Sequence[RankInfo], limit_bytes: int | None):
        info = infos[0]
        self.mapper = mapper
        self.info = info
        self.layout = info.layout
        self.group_bytes = info.group_bytes
        self.pool = ShardedPoolView(mapper, info, limit_bytes)
        self.device_margin = max(DEVICE_MARGIN_BYTES, 2 * self.group_bytes)
        self.host_slots = min(i.host_slots for i in infos)  # a slot must exist on every rank

    @property
    def world(self) -> int:
        return self.info.world

    def mappable_groups(self, unmapped: int) -> int:
        """Groups that could still be mapped on every rank: the limit and the fullest GPU decide."""
        if self.mapper.backing_off():
            return 0
        device_free = self.mapper.device_free_bytes()
        if device_free is not None:
            device_free = max(0, device_free - self.device_margin)
        return groups_within(self.pool.headroom_estimate(device_free), unmapped, self.group_bytes)

    def stats(self) -> PoolStats:
        return self.pool.stats()
