"""Spill cold prefix blocks to the host tier, and bring them back on a prefix hit.

The manager is the glue between the page-aware free queue (which decides when
cached blocks leave the GPU), the host tier (which decides what stays on the
host) and the copier (which moves bytes). It hooks in at two points of vLLM's
own block pool:

* before cached blocks are evicted (their group released, or the block reused
  under memory pressure) their data is copied to host slots;
* when the scheduler looks up a block hash that the GPU no longer holds but the
  host does, a free GPU block is taken, registered under that hash, and filled
  from the host before the next forward pass. vLLM then sees an ordinary GPU
  prefix hit and skips recomputing it.

Only free blocks that hold no cached prefix are used for loads, so a load can
never evict a block the scheduler has just matched for the same request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from kvelastic.offload.host_tier import HostTier
from kvelastic.pool.backend import Fence
from kvelastic.roles import Copier


@dataclass
class OffloadCounters:
    spilled_blocks: int = 0
    reloaded_blocks: int = 0
    spill_batches: int = 0
    load_batches: int = 0


class OffloadManager:
    """Moves cached blocks between one GPU block pool and one host tier.

    ``enter_block(block, key)`` gives a free block the hash ``key`` and enters
    it in the pool's prefix-cache map, the way the running vLLM release does
    (``kvelastic/hooks/offload_setup.py`` builds it). ``copier`` moves the
    bytes in this process, or sends each rank the command to move its shard.
    """

    def __init__(self, tier: HostTier, copier: Copier, queue: Any,
                 enter_block: Callable[[Any, Hashable], None]):
        self.tier = tier
        self.copier = copier
        self.queue = queue
        self.enter_block = enter_block
        self.counters = OffloadCounters()
        self._after_reset: list[Callable[[], None]] = []
        self._pending_loads: list[tuple[int, int]] = []
        self._pending_spills: list[tuple[int, int]] = []
        self._matched: set[int] = set()  # blocks the scheduler matched this step

    # ------------------------------------------------------------------ spill
    def spill(self, blocks: Sequence[Any], *, before_reuse: bool) -> Fence | None:
        """Copy the cached ``blocks`` to the host tier.

        ``before_reuse``: the blocks are being handed to new requests in this
        scheduling step. Their copies are batched and issued at :meth:`flush`,
        before the step's compute, which then waits for them. Otherwise (a
        group is being released) the copy is issued now and the returned fence
        passes when it is done, so the group is unmapped only after it.
        """
        ids: list[int] = []
        slots: list[int] = []
        for block in blocks:
            key = block.block_hash
            if key is None:
                continue
            slot = self.tier.admit(key)
            if slot is not None:
                ids.append(block.block_id)
                slots.append(slot)
        if not ids:
            return None
        self.counters.spilled_blocks += len(ids)
        if before_reuse:
            self._pending_spills.extend(zip(ids, slots))
            return None
        self.counters.spill_batches += 1
        return self.copier.store(ids, slots)

    # ----------------------------------------------------------------- reload
    def load_on_miss(self, key: Hashable) -> Any | None:
        """A GPU block now holding (or about to hold) ``key``'s data, or None on a host miss."""
        if key not in self.tier:
            self.tier.misses += 1
            return None
        block = self.queue.take_block_for_load(self._matched)
        if block is None:
            return None
        self._matched.add(block.block_id)
        slot = self.tier.lookup(key)
        if slot is None:  # pragma: no cover - checked just above
            self.queue.append(block)
            return None
        self.enter_block(block, key)
        self.queue.append(block)  # a free, cached block, as if it had never left
        self._pending_loads.append((block.block_id, slot))
        return block

    def matched(self, block: Any) -> None:
        """The scheduler found ``block`` in the GPU prefix cache this step: never evict it for a load."""
        self._matched.add(block.block_id)

    def flush(self) -> None:
        """Issue the step's spills, then its loads, each as one batch (in that order on one stream)."""
        self._matched.clear()
        if self._pending_spills:
            ids = [b for b, _ in self._pending_spills]
            slots = [s for _, s in self._pending_spills]
            self._pending_spills.clear()
            self.copier.store(ids, slots, block_compute=True)
            self.counters.spill_batches += 1
        if not self._pending_loads:
            return
        ids = [b for b, _ in self._pending_loads]
        slots = [s for _, s in self._pending_loads]
        self._pending_loads.clear()
        self.copier.load(ids, slots)
        self.counters.reloaded_blocks += len(ids)
        self.counters.load_batches += 1

    def on_reset(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after each :meth:`reset` (the lookup hook follows vLLM's new prefix map)."""
        self._after_reset.append(callback)

    def reset(self) -> None:
        """vLLM reset its prefix cache (new weights, say): drop the host copies too."""
        self.flush()
        self.tier.clear()
        for callback in self._after_reset:
            callback()

    def stats(self) -> dict[str, Any]:
        t = self.tier.stats()
        return {"host_slots": t.slots, "host_pinned_bytes": t.slots * t.slot_bytes,
                "host_bytes_used": t.bytes_used, "host_hits": t.hits,
                "host_misses": t.misses, "arc_p": t.arc_p, "spilled_bytes": self.counters.spilled_blocks
                * self.copier.bytes_per_block, "reloaded_bytes": self.counters.reloaded_blocks
                * self.copier.bytes_per_block, "spill_batches": self.counters.spill_batches,
                "load_batches": self.counters.load_batches}
