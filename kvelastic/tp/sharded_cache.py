"""The scheduler's view of a KV cache whose tensors live on other processes' GPUs.

:class:`ShardedKVCache` fills the :class:`~kvelastic.roles.SchedulerCache` role
(the block-to-group layout, bytes per group, how many more groups could be
mapped) and :class:`ShardedPoolView` the :class:`~kvelastic.roles.PoolView`
role: accounting, not memory. Bytes are per rank: every rank maps the same
groups, and vLLM profiled the limit per GPU.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, ContextManager

from kvelastic.scheduler.elastic_cache import DEVICE_FREE_TTL_S, GroupedBlocks, least_room
from kvelastic.pool.stats import PoolStats
from kvelastic.roles import PoolView
from kvelastic.tp.rank_info import RankInfo
from kvelastic.tp.idle_steps import IdleSteps
from kvelastic.tp.remote_mapper import RemoteMapper


class ShardedPoolView(PoolView):
    """Pool-shaped accounting over the groups the scheduler has mapped on every rank."""

    def __init__(self, mapper: RemoteMapper, info: RankInfo, limit_bytes: int | None,
                 lock: ContextManager | None = None):
        """``lock``: the scheduler's, so that commands sent while idle never race a scheduling step."""
        self.mapper = mapper
        self.page_bytes = info.page_bytes
        self.group_bytes = info.group_bytes
        self.num_groups = info.layout.num_groups
        self.limit_bytes = limit_bytes
        self.lock: ContextManager = lock if lock is not None else threading.RLock()
        self.reserve_pages = 0  # the warm reserve every rank was last told to keep
        self.idle_steps: IdleSteps | None = None  # idle commands by an empty step, where the loop can be woken

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
        """The reclaimer's periodic call: commands queued while idle go out now, on an empty step where the
        engine loop can be woken for one (:mod:`kvelastic.tp.idle_steps`), else with the next step."""
        with self.lock:
            if self.idle_steps is not None:
                self.idle_steps.deliver()
        return 0

    def grow_reserve(self, pages: int) -> int:
        """The reclaimer's warm reserve, kept by every rank: a command, sent when the target changes."""
        return self._set_reserve(self.reserve_pages + max(0, pages))

    def trim_reserve(self, keep_pages: int = 0) -> int:
        return self._set_reserve(min(self.reserve_pages, keep_pages))

    def _set_reserve(self, pages: int) -> int:
        if pages == self.reserve_pages:
            return 0
        change = pages - self.reserve_pages
        if not self.mapper.request_reserve(pages, change * self.page_bytes):
            return 0  # the GPU's shared account has no room for it
        self.reserve_pages = pages
        return abs(change)

    def set_limit(self, limit_bytes: int | None) -> None:
        """Ranks map only what the scheduler asks for, so the limit is kept here, not on the ranks."""
        self.limit_bytes = limit_bytes


class ShardedKVCache(GroupedBlocks):
    """Layout and capacity of the KV cache every rank holds a shard of."""

    pool: ShardedPoolView

    def __init__(self, mapper: RemoteMapper, info: RankInfo, limit_bytes: int | None,
                 lock: ContextManager | None = None):
        self.mapper = mapper
        self.layout = info.layout
        self.group_bytes = info.group_bytes
        self.pool = ShardedPoolView(mapper, info, limit_bytes, lock)
        self.external_headroom: Callable[[], int | None] | None = None
        self._external_cache: tuple[float, int | None] = (0.0, None)

    def device_room(self) -> int | None:
        """The fullest GPU decides, within the shared account's grant; none at all while the ranks back
        off (a refusal, or a dead rank)."""
        if self.mapper.backing_off():
            return 0
        return least_room(self.beyond_margin(self.mapper.device_free_bytes()), self._external_room())

    def _external_room(self) -> int | None:
        """The account's grant, asked at most every 50 ms (as a pool in the scheduler's process asks it)."""
        if self.external_headroom is None:
            return None
        stamp, room = self._external_cache
        now = time.monotonic()
        if now - stamp > DEVICE_FREE_TTL_S:
            room = self.external_headroom()
            self._external_cache = (now, room)
        return room

    def forget_device_free(self) -> None:
        """The ranks' reports are read as they come; only the account's grant is kept, and dropped here."""
        self._external_cache = (0.0, None)
