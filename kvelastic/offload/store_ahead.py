"""Host copies stored ahead of eviction: resident in a slot, not yet requested from the policy.

Write-through copies a cached block to the host once its data is computed,
long before the block leaves the GPU (if it ever does). Such a copy is not a
request for the block: while the GPU holds the block, no lookup reaches the
host tier for it. So the policy does not see it. The copy waits here, in a
slot outside the policy, until the block is evicted from the GPU; the eviction
then makes exactly the request it makes without write-through
(:meth:`HostTier.adopt`), only without a copy. ARC (or LRU) therefore sees the
same sequence of requests in both modes, and stays exact.

Room: the policy manages ``slots - ahead_slots`` slots, so stored-ahead copies
always have ``ahead_slots`` of their own, plus any slot the policy leaves free.
When the policy needs a slot and none is free, the oldest stored-ahead copy
gives its slot up (its block, if evicted later, is copied then, as without
write-through). A new copy that finds no free slot is not made: dropping a
finished copy for a newer one would only move the same bytes twice.

Nothing is served from here: a lookup finds a key only once the policy admitted
it. Every copy into or out of a slot goes through the one copy stream, in the
order issued, so a slot given up here and reused (or adopted, then read by a
load) is never written or read before the copy queued into it earlier.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvelastic.offload.host_tier import HostTier


class AheadCopies:
    """Keys stored ahead, each with its slot and the GPU block it was copied from; oldest first."""

    def __init__(self, tier: HostTier):
        self.tier = tier
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()
        self._key_of_block: dict[int, Hashable] = {}
        self._block_of_key: dict[Hashable, int] = {}
        self.dropped = 0  # copies given up before their block was evicted (slot needed elsewhere, stale)
        tier.reclaim_slot = self._give_up_oldest

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def key_of_block(self, block_id: int) -> Hashable | None:
        """The key ``block_id`` was copied ahead under, if its copy is still here."""
        return self._key_of_block.get(block_id)

    def wants(self, key: Hashable) -> bool:
        """True if a copy of ``key`` is worth making: neither the policy nor this area holds it."""
        return key not in self._slot_of and key not in self.tier

    def place(self, key: Hashable, block_id: int) -> int | None:
        """A slot for a copy of ``block_id`` under ``key``, or None when no slot is free (no copy then)."""
        self.forget_block(block_id)  # the block held another key before: that copy is stale
        slot = self.tier.free_slot()
        if slot is None:
            return None
        self._slot_of[key] = slot
        self._key_of_block[block_id] = key
        self._block_of_key[key] = block_id
        return slot

    def promote(self, key: Hashable) -> bool:
        """A block holding ``key`` leaves the GPU: the policy admits the copy made ahead; False if none."""
        slot = self._pop(key)
        if slot is None:
            return False
        self.tier.adopt(key, slot)
        return True

    def forget_block(self, block_id: int) -> None:
        """``block_id`` lost the key it was copied under (vLLM dropped its hash): drop that copy."""
        key = self._key_of_block.get(block_id)
        if key is not None:
            slot = self._pop(key)
            if slot is not None:
                self.tier.give_slot(slot)
                self.dropped += 1

    def clear(self) -> None:
        """Forget every copy (the tier was cleared: its slots are all free again)."""
        self._slot_of.clear()
        self._key_of_block.clear()
        self._block_of_key.clear()

    def _pop(self, key: Hashable) -> int | None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            block = self._block_of_key.pop(key)
            if self._key_of_block.get(block) == key:
                del self._key_of_block[block]
        return slot

    def _give_up_oldest(self) -> int:
        """The tier needs a slot for the policy and none is free: the oldest copy made ahead yields its own."""
        if not self._slot_of:
            raise LookupError("internal: the host tier is short of a slot but holds no copy made ahead")
        key = next(iter(self._slot_of))
        slot = self._pop(key)
        self.dropped += 1
        assert slot is not None
        return slot
