"""Pinned host memory that keeps spilled KV blocks, one slot per block, under a policy.

The buffer is allocated and pinned once, at start-up (pinning tens of GiB takes
seconds, and doing it on the serving path would stall requests), then carved
into slots of one block's bytes across all layers. The replacement policy
(ARC by default) decides which block hashes stay when the tier is full; a slot
is freed the moment the policy evicts its key. Copies into a freed slot are
queued behind earlier copies on the same stream, so reuse needs no pin. Free
slots are handed out lowest first, so a batch tends to land in consecutive
slots, which the staged copier moves in one DMA each.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

from kvelastic.errors import ConfigError, KvelasticError
from kvelastic.offload.arc import ARC
from kvelastic.offload.lru import LRU
from kvelastic.offload.policy import EvictionPolicy
from kvelastic.units import format_size

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.kvelastic")


class HostTierError(KvelasticError):
    """The host tier could not be set up (for example the memory cannot be pinned)."""


@dataclass(frozen=True)
class HostTierStats:
    slots: int
    slots_used: int
    slot_bytes: int
    hits: int
    misses: int
    admitted: int
    evicted: int
    arc_p: float | None

    @property
    def bytes_used(self) -> int:
        return self.slots_used * self.slot_bytes


def allocate_slots(slots: int, slot_bytes: int, *, pin: bool) -> "torch.Tensor":
    """One (slots, slot_bytes) int8 host buffer, pinned if asked; a clear error if it cannot be had."""
    import torch

    try:
        return torch.empty((slots, slot_bytes), dtype=torch.int8, pin_memory=pin)
    except RuntimeError as exc:
        raise HostTierError(f"cannot {'pin' if pin else 'allocate'} {format_size(slots * slot_bytes)} "
                            f"of host memory for the KV host tier ({exc}); lower KVELASTIC_CPU_BYTES") from exc


class HostTier:
    """Slots of pinned host memory indexed by block hash."""

    def __init__(self, capacity_bytes: int, slot_bytes: int, *, pin: bool, policy: str = "arc",
                 allocate: bool = True, ahead_slots: int = 0):
        """``allocate=False``: an index only; the slots' memory lives elsewhere (one buffer per TP rank).

        ``ahead_slots``: slots kept outside the policy for copies stored ahead
        of eviction (write-through, :mod:`kvelastic.offload.store_ahead`); the
        policy manages the rest.
        """
        slots = capacity_bytes // slot_bytes
        if slots < 1:
            raise ConfigError(f"KVELASTIC_CPU_BYTES={capacity_bytes} holds no block of {slot_bytes} bytes")
        if not 0 <= ahead_slots < slots:
            raise ConfigError(f"the write-through share ({ahead_slots} blocks) must leave the host tier's policy "
                              f"at least one of its {slots} blocks; lower KVELASTIC_CPU_AHEAD")
        start = time.perf_counter()
        self.buffer = allocate_slots(slots, slot_bytes, pin=pin) if allocate else None
        self.pin_seconds = time.perf_counter() - start
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.policy: EvictionPolicy = (ARC if policy == "arc" else LRU)(slots - ahead_slots, on_evict=self._evicted)
        self._free = list(range(slots))  # a heap
        #: Called for a slot when none is free (write-through's copies give one up); None: never short.
        self.reclaim_slot: Callable[[], int] | None = None
        self._slot_of: dict[Hashable, int] = {}
        self.hits = self.misses = self.admitted = self.evicted = 0
        log.info("kvelastic: host tier of %s (%d blocks of %s) %s in %.2f s, policy %s",
                 format_size(slots * slot_bytes), slots, format_size(slot_bytes),
                 "pinned" if pin and allocate else "allocated" if allocate else "indexed", self.pin_seconds,
                 policy)

    def admit(self, key: Hashable) -> int | None:
        """A slot to copy ``key``'s block into, or None when the tier already holds it."""
        if self.admit_held(key):
            return None
        self.policy.request(key)  # a miss: admits the key, evicting as the policy says
        slot = self.take_slot()
        self._slot_of[key] = slot
        self.admitted += 1
        return slot

    def adopt(self, key: Hashable, slot: int) -> None:
        """Admit ``key`` whose data already sits in ``slot`` (stored ahead): the same request as :meth:`admit`,
        no copy. If the policy already held ``key``, ``slot`` is simply freed."""
        if self.admit_held(key):
            self.give_slot(slot)
            return
        self.policy.request(key)
        self._slot_of[key] = slot
        self.admitted += 1

    def admit_held(self, key: Hashable) -> bool:
        """If the policy holds ``key``, request it as :meth:`admit` does (no copy needed) and say so."""
        if key in self._slot_of:
            self.policy.request(key)
            return True
        return False

    def take_slot(self) -> int:
        """A free slot, lowest first; when none is free, one :attr:`reclaim_slot` gives up."""
        if self._free:
            return heapq.heappop(self._free)
        if self.reclaim_slot is None:
            raise HostTierError("internal: no free host slot and nothing to reclaim one from")
        return self.reclaim_slot()

    def free_slot(self) -> int | None:
        """A free slot, or None: never one the policy holds."""
        return heapq.heappop(self._free) if self._free else None

    def give_slot(self, slot: int) -> None:
        """``slot`` (from :meth:`take_slot` or :meth:`free_slot`) is free again."""
        heapq.heappush(self._free, slot)

    def lookup(self, key: Hashable) -> int | None:
        """The slot holding ``key``, counting a hit (and telling the policy), or None."""
        slot = self._slot_of.get(key)
        if slot is None:
            self.misses += 1
            return None
        self.policy.request(key)
        self.hits += 1
        return slot

    def clear(self) -> None:
        """Forget every block (vLLM's prefix cache was reset: host copies are stale too)."""
        self.policy = type(self.policy)(self.policy.capacity, on_evict=self._evicted)
        self._free = list(range(self.slots))
        self._slot_of.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def _evicted(self, key: Hashable) -> None:
        heapq.heappush(self._free, self._slot_of.pop(key))
        self.evicted += 1

    def stats(self) -> HostTierStats:
        p = self.policy.p if isinstance(self.policy, ARC) else None
        return HostTierStats(slots=self.slots, slots_used=self.slots - len(self._free),
                             slot_bytes=self.slot_bytes, hits=self.hits, misses=self.misses,
                             admitted=self.admitted, evicted=self.evicted, arc_p=p)
