"""One engine's elastic KV cache: the pool, its tensors, and the block-to-group layout.

The worker side creates it when vLLM allocates KV tensors; the scheduler side
looks it up to map a group before handing out its blocks and to unmap a group
once its blocks are free. Both run in the engine-core process on one GPU.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from kvelastic.integration.kv_layout import KVGroupLayout
from kvelastic.pool import Fence, PagePool

if TYPE_CHECKING:
    from kvelastic.pool.stats import PoolStats

DEVICE_MARGIN_BYTES = 256 * 1024 * 1024  # left free on the GPU for others' allocations
NULL_GROUP = 0  # holds vLLM's null block (block 0), read by dummy and padded runs


class GroupedBlocks:
    """Block-to-group arithmetic over ``self.layout``, shared by every view of an engine's KV cache."""

    layout: KVGroupLayout

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


def groups_within(room: int | None, unmapped: int, group_bytes: int) -> int:
    """How many of ``unmapped`` groups fit in ``room`` bytes (no room figure: all of them)."""
    if room is None:
        return unmapped
    return max(0, min(unmapped, room // max(1, group_bytes)))


class ElasticKVCache(GroupedBlocks):
    """The KV tensors of one engine, mapped a group of blocks at a time."""

    def __init__(self, pool: PagePool, layout: KVGroupLayout):
        self.pool = pool
        self.layout = layout
        pool.set_layout(layout)
        self.group_bytes = layout.bytes_per_group()
        self._device_free_cache: tuple[float, int | None] = (0.0, None)
        self.device_margin = max(DEVICE_MARGIN_BYTES, 2 * self.group_bytes)
        #: Bytes a budget outside this process still grants us (the GPU's shared account), or None.
        self.external_headroom: Callable[[], int | None] | None = None
        pool.map_groups([NULL_GROUP])

    def map_groups(self, groups: Iterable[int], *, force: bool = False) -> None:
        """Map groups before their blocks are handed out; raises PoolExhausted."""
        self.pool.map_groups(groups, force=force)
        self.forget_device_free()

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

    def mappable_groups(self, unmapped: int) -> int:
        """How many of ``unmapped`` groups could be mapped now, within the limit and the device.

        Called several times per scheduling step, so it takes no lock and reads
        the device's free memory at most every 50 ms, keeping a safety margin
        for what others allocate in between.
        """
        stamp, device_free = self._device_free_cache
        now = time.monotonic()
        if now - stamp > 0.05:
            device_free = self.pool.backend.device_free_bytes()
            if device_free is not None:
                device_free = max(0, device_free - self.device_margin)
            external = self.external_headroom() if self.external_headroom is not None else None
            if external is not None:
                device_free = external if device_free is None else min(device_free, external)
            self._device_free_cache = (now, device_free)
        return groups_within(self.pool.headroom_estimate(device_free), unmapped, self.group_bytes)

    def stats(self) -> "PoolStats":
        return self.pool.stats()
