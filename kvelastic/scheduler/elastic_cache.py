"""One engine's elastic KV cache: the pool, its tensors, and the block-to-group layout.

The worker side creates it when vLLM allocates KV tensors; the scheduler side
looks it up to map a group before handing out its blocks and to unmap a group
once its blocks are free. Both run in the engine-core process on one GPU.
Under tensor parallelism each rank holds one and the scheduler sees them all
through :class:`~kvelastic.tp.sharded_cache.ShardedKVCache`; what both views
compute alike (block arithmetic, the groups that still fit) is
:class:`GroupedBlocks`.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Callable, Iterable, Sequence

from kvelastic.errors import PoolExhausted
from kvelastic.pool.kv_layout import KVGroupLayout
from kvelastic.pool import Fence, PagePool
from kvelastic.roles import PoolView, SchedulerCache

DEVICE_MARGIN_BYTES = 256 * 1024 * 1024  # left free on the GPU for others' allocations
NULL_GROUP = 0  # holds vLLM's null block (block 0), read by dummy and padded runs
DEVICE_FREE_TTL_S = 0.05


def groups_within(room: int | None, unmapped: int, group_bytes: int) -> int:
    """How many of ``unmapped`` groups fit in ``room`` bytes (no room figure: all of them)."""
    if room is None:
        return unmapped
    return max(0, min(unmapped, room // max(1, group_bytes)))


def least_room(room: int | None, grant: int | None) -> int | None:
    """The smaller of the device's room and a budget's grant, either of which may be unknown (None)."""
    if room is None:
        return grant
    return room if grant is None else min(room, grant)


class GroupedBlocks(SchedulerCache):
    """Block arithmetic and the room left, computed alike by every view of an engine's KV cache.

    How many more groups fit is the pool's room within the device's free
    memory less a margin kept for others' allocations; each view says how it
    reads the device (:meth:`device_room`).
    """

    layout: KVGroupLayout
    group_bytes: int
    pool: PoolView
    #: Told the bytes that waiting requests need beyond what a budget outside this process grants (the
    #: GPU's shared account), so the others give them back; None where there is no such budget.
    external_want: Callable[[int], None] | None = None
    #: Why the pool last refused a map (the limit, the shared account or the device), for the commit
    #: guard's log line; None until one is refused (and in views whose ranks report no reason).
    last_refusal: PoolExhausted | None = None

    @property
    def blocks_per_group(self) -> int:
        return self.layout.blocks_per_group

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def group_of_block(self, block_id: int) -> int:
        return self.layout.group_of_block(block_id)

    def blocks_of_group(self, group: int) -> range:
        return self.layout.blocks_of_group(group)

    @property
    def device_margin(self) -> int:
        """Bytes left free on the device for others' allocations: 256 MiB, or two groups if larger."""
        return max(DEVICE_MARGIN_BYTES, 2 * self.group_bytes)

    def beyond_margin(self, device_free: int | None) -> int | None:
        """``device_free`` bytes less the margin (None stays None: the device's size is unknown)."""
        return None if device_free is None else max(0, device_free - self.device_margin)

    @abstractmethod
    def device_room(self) -> int | None:
        """Bytes the device can still give this cache after the margin; None if unknown."""

    def mappable_groups(self, unmapped: int) -> int:
        """How many of ``unmapped`` groups could be mapped now, within the limit and the device."""
        return groups_within(self.pool.headroom_estimate(self.device_room()), unmapped, self.group_bytes)


class ElasticKVCache(GroupedBlocks):
    """The KV tensors of one engine, mapped a group of blocks at a time."""

    pool: PagePool

    def __init__(self, pool: PagePool, layout: KVGroupLayout):
        self.pool = pool
        self.layout = layout
        pool.set_layout(layout)
        self.group_bytes = layout.bytes_per_group()
        self._device_free_cache: tuple[float, int | None] = (0.0, None)
        #: Bytes a budget outside this process still grants us (the GPU's shared account), or None.
        self.external_headroom: Callable[[], int | None] | None = None
        pool.map_groups([NULL_GROUP])

    def map_groups(self, groups: Iterable[int], *, force: bool = False) -> None:
        """Map groups before their blocks are handed out; raises PoolExhausted."""
        self.pool.map_groups(groups, force=force)
        self.forget_device_free()

    def map_first_blocks(self, count: int, *, force: bool = False) -> None:
        """Map the groups of blocks ``[0, count)``, the null block's at least (what vLLM addresses before a
        scheduler hands blocks out: start-up warm-up)."""
        last = self.group_of_block(min(max(1, count), self.num_blocks) - 1)
        self.map_groups(range(last + 1), force=force)

    def map_as_many(self, groups: Sequence[int], *, force: bool = False) -> int:
        """Map ``groups`` in order, as far as the pool allows; return how many, counted from the front.

        All at once where they fit (one driver batch); else one by one up to
        the first the pool refuses: every group after it would need as much.
        """
        try:
            self.map_groups(groups, force=force)
            return len(groups)
        except PoolExhausted:
            pass
        for done, group in enumerate(groups):
            try:
                self.map_groups([group], force=force)
            except PoolExhausted as refusal:
                self.last_refusal = refusal
                return done
        return len(groups)

    def unmap_groups(self, groups: Iterable[int], after: Sequence[Fence] = ()) -> None:
        """Unmap groups whose blocks are all free, once the GPU (and every ``after`` fence) is done."""
        groups = [g for g in groups if g != NULL_GROUP]
        if groups:
            fence: Fence = self.pool.backend.record_fence()
            if after:
                from kvelastic.offload.fences import AllFences

                fence = AllFences([fence, *after])
            self.pool.unmap_groups(groups, fence=fence)
            self.forget_device_free()

    def forget_device_free(self) -> None:
        """The device's free memory changed (we mapped or unmapped, or it refused what the last
        reading promised): read it again next time."""
        self._device_free_cache = (0.0, None)

    def device_room(self) -> int | None:
        """The device's free bytes less the margin, within the shared account's grant.

        Asked several times per scheduling step, so it takes no lock and reads
        the device at most every 50 ms; the margin covers what others allocate
        in between.
        """
        stamp, room = self._device_free_cache
        now = time.monotonic()
        if now - stamp > DEVICE_FREE_TTL_S:
            external = self.external_headroom() if self.external_headroom is not None else None
            room = least_room(self.beyond_margin(self.pool.backend.device_free_bytes()), external)
            self._device_free_cache = (now, room)
        return room
