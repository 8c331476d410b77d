"""Pinned host memory that keeps spilled KV blocks, one slot per block, under a policy.

The buffer is allocated at start-up and pinned in the background
(``host_memory.py``: pinning tens of GiB takes tens of seconds), then carved
into slots of one block's bytes across all layers. Only slots already pinned
are handed out: the policy's capacity grows with them, drained from the
supply at the next admission, so the engine serves at once with a tier that
grows (or, if the host refuses to pin more, stays smaller). The replacement policy
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
from typing import Callable, Hashable

from kvelastic.errors import ConfigError, KvelasticError
from kvelastic.offload.arc import ARC
from kvelastic.offload.host_memory import CudaPinner, HostMemory, PinError, SlotSupply
from kvelastic.offload.lru import LRU
from kvelastic.offload.policy import AllPinnedError, EvictionPolicy
from kvelastic.units import format_size

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


def allocate_slots(slots: int, slot_bytes: int, *, pin: bool, deferred: bool = False) -> HostMemory:
    """A (slots, slot_bytes) int8 host buffer, pinned in the background if asked; a clear error if it
    cannot be had or this host cannot pin at all (its first chunk is pinned before this returns).
    ``deferred``: the background pinning waits for :meth:`HostMemory.begin`."""
    try:
        return HostMemory(slots, slot_bytes, pinner=CudaPinner() if pin else None, deferred=deferred)
    except (PinError, OSError, RuntimeError) as exc:
        raise HostTierError(f"cannot {'pin' if pin else 'allocate'} {format_size(slots * slot_bytes)} "
                            f"of host memory for the KV host tier ({exc}); lower KVELASTIC_CPU_BYTES") from exc


class HostTier:
    """Slots of pinned host memory indexed by block hash."""

    def __init__(self, capacity_bytes: int, slot_bytes: int, *, pin: bool, policy: str = "arc",
                 allocate: bool = True, supply: SlotSupply | None = None, ahead_slots: int = 0):
        """``allocate=False``: an index only; the slots' memory lives elsewhere (one buffer per TP rank),
        and ``supply`` says how many of them every rank has pinned (None: all of them).

        ``ahead_slots``: slots kept outside the policy for copies stored ahead
        of eviction (write-through, :mod:`kvelastic.offload.store_ahead`); the
        policy manages the rest of the slots pinned so far.
        """
        slots = capacity_bytes // slot_bytes
        if slots < 1:
            raise ConfigError(f"KVELASTIC_CPU_BYTES={capacity_bytes} holds no block of {slot_bytes} bytes")
        if not 0 <= ahead_slots < slots:
            raise ValueError(f"the write-through share ({ahead_slots} blocks) must leave the host tier's policy "
                             f"at least one of its {slots} blocks")
        start = time.perf_counter()
        self.memory = allocate_slots(slots, slot_bytes, pin=pin) if allocate else None
        self.buffer = self.memory.buffer if self.memory is not None else None
        self.pin_seconds = time.perf_counter() - start  # the constructor's share; the rest is in the background
        self.slot_bytes = slot_bytes
        self.slots = slots  # all of them, pinned or not yet
        self.ahead_slots = ahead_slots
        self._ready = 0  # slots pinned (on every rank) and handed out so far
        self._policy_type = ARC if policy == "arc" else LRU
        self.policy: EvictionPolicy | None = None  # made once it has a slot, grown with the others
        self._free: list[int] = []  # a heap
        #: Called for a slot when none is free (write-through's copies give one up); None: never short.
        self.reclaim_slot: Callable[[], int] | None = None
        self._supply: SlotSupply | None = self.memory or supply
        self._slot_of: dict[Hashable, int] = {}
        self.hits = self.misses = self.admitted = self.evicted = 0
        self.refused_all_pinned = 0  # blocks not kept: every resident one was pinned by a load
        if self._supply is None:
            self._grow_to(slots)
        else:
            self._take_ready()
        log.info("kvelastic: host tier of %s (%d blocks of %s) %s in %.2f s%s, policy %s",
                 format_size(slots * slot_bytes), slots, format_size(slot_bytes),
                 "allocated" if allocate else "indexed", self.pin_seconds,
                 "" if self._supply is None or self._supply.settled else ", pinning in the background", policy)

    def admit(self, key: Hashable) -> int | None:
        """A slot to copy ``key``'s block into, or None when the tier already holds it (or the policy
        has no slot pinned yet, or every block it holds is pinned by a load: the block is not kept)."""
        self.refresh()
        if self.policy is None or self.admit_held(key) or not self._request_new(key):
            return None
        slot = self.take_slot()
        self._slot_of[key] = slot
        self.admitted += 1
        return slot

    def adopt(self, key: Hashable, slot: int) -> None:
        """Admit ``key`` whose data already sits in ``slot`` (stored ahead): the same request as :meth:`admit`,
        no copy. If the policy already held ``key`` (or has no slot yet), ``slot`` is simply freed."""
        if self.policy is None or self.admit_held(key) or not self._request_new(key):
            self.give_slot(slot)
            return
        self._slot_of[key] = slot
        self.admitted += 1

    def _request_new(self, key: Hashable) -> bool:
        """Request ``key``, which the policy lacks (a miss: it is admitted, evicting as the policy says);
        False, with nothing changed, when every resident key is pinned by a load in flight."""
        try:
            self.policy.request(key)  # type: ignore[union-attr]
        except AllPinnedError:
            self.refused_all_pinned += 1
            return False
        return True

    def admit_held(self, key: Hashable) -> bool:
        """If the policy holds ``key``, request it as :meth:`admit` does (no copy needed) and say so."""
        if self.policy is not None and key in self._slot_of:
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
        self.refresh()
        return heapq.heappop(self._free) if self._free else None

    def give_slot(self, slot: int) -> None:
        """``slot`` (from :meth:`take_slot` or :meth:`free_slot`) is free again."""
        heapq.heappush(self._free, slot)

    def lookup(self, key: Hashable) -> int | None:
        """The slot holding ``key``, counting a hit (and telling the policy), or None."""
        slot = self._slot_of.get(key)
        if slot is None or self.policy is None:
            self.misses += 1
            return None
        self.policy.request(key)
        self.hits += 1
        return slot

    def pin(self, key: Hashable) -> None:
        """Keep ``key`` (and its slot) until :meth:`unpin`: a load still has to read it (nested by count)."""
        assert self.policy is not None and key in self._slot_of, f"internal: pinning {key!r}, which the tier lacks"
        self.policy.pin(key)

    def unpin(self, key: Hashable) -> None:
        """One :meth:`pin` of ``key`` is over."""
        if self.policy is not None and key in self._slot_of:
            self.policy.unpin(key)

    def clear(self) -> None:
        """Forget every block (vLLM's prefix cache was reset: host copies are stale too)."""
        if self.policy is not None:
            self.policy = self._policy_type(self.policy.capacity, on_evict=self._evicted)
        self._free = list(range(self._ready))
        self._slot_of.clear()

    def refresh(self) -> None:
        """Take in the slots pinned since the last call (nothing once pinning has settled)."""
        if self._supply is not None:
            self._take_ready()

    def _take_ready(self) -> None:
        """Hand out the slots pinned since the last call; stop asking once the supply has settled."""
        supply = self._supply
        assert supply is not None
        settled = supply.settled  # read first: a settled supply's count is final
        self._grow_to(min(supply.ready_slots, self.slots))
        if settled:
            self._supply = None

    def _grow_to(self, slots: int) -> None:
        """``slots`` are pinned now: the new ones become free, and the policy grows to all but the ahead share."""
        if slots <= self._ready:
            return
        for slot in range(self._ready, slots):
            heapq.heappush(self._free, slot)
        self._ready = slots
        capacity = slots - self.ahead_slots
        if capacity <= 0:
            return
        if self.policy is None:
            self.policy = self._policy_type(capacity, on_evict=self._evicted)
        else:
            self.policy.grow(capacity)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def _evicted(self, key: Hashable) -> None:
        heapq.heappush(self._free, self._slot_of.pop(key))
        self.evicted += 1

    def stats(self) -> HostTierStats:
        p = self.policy.p if isinstance(self.policy, ARC) else None
        return HostTierStats(slots=self._ready, slots_used=self._ready - len(self._free),
                             slot_bytes=self.slot_bytes, hits=self.hits, misses=self.misses,
                             admitted=self.admitted, evicted=self.evicted, arc_p=p)
