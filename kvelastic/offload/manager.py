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

A third path loads ahead (:meth:`OffloadManager.prefetch`): the host-held
prefixes of requests next in line are loaded right after a scheduling step,
beside that step's compute instead of in front of a later one. Such a block is
registered as cached at once; whatever touches it before its load is done (the
scheduler matching it, a new request reusing it, its group being unmapped) is
ordered after the load's fence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence

from kvelastic.offload.copier import BlockCopier
from kvelastic.offload.fences import AllFences
from kvelastic.offload.host_tier import HostTier
from kvelastic.pool.backend import Fence


@dataclass
class OffloadCounters:
    spilled_blocks: int = 0
    reloaded_blocks: int = 0
    prefetched_blocks: int = 0
    spill_batches: int = 0
    load_batches: int = 0


class OffloadManager:
    """Moves cached blocks between one GPU block pool and one host tier."""

    def __init__(self, tier: HostTier, copier: BlockCopier, queue: Any, block_pool: Any):
        self.tier = tier
        self.copier = copier
        self.queue = queue
        self.block_pool = block_pool
        self.counters = OffloadCounters()
        self.gpu_lookup: Callable[[Hashable], Any] | None = None  # the prefix map's own lookup (hook_lookup)
        self._pending_loads: list[tuple[int, int]] = []
        self._pending_spills: list[tuple[int, int]] = []
        self._matched: set[int] = set()  # blocks the scheduler matched this step
        self._loading: dict[int, tuple[int, Fence]] = {}  # block -> (batch number, fence) of loads ahead
        self._unused_ahead: set[int] = set()  # loaded ahead, not yet matched by the scheduler
        self._batches = itertools.count()
        self._compute_after: tuple[int, Fence] | None = None  # the latest load-ahead batch compute must follow

    # ------------------------------------------------------------------ spill
    def spill(self, blocks: Sequence[Any], *, before_reuse: bool) -> Fence | None:
        """Copy the cached ``blocks`` to the host tier.

        ``before_reuse``: the blocks are being handed to new requests in this
        scheduling step. Their copies are batched and issued at :meth:`flush`,
        before the step's compute, which then waits for them. Otherwise (a
        group is being released) the copy is issued now and the returned fence
        passes when it and any load ahead into these blocks are done, so the
        group is unmapped only after them.
        """
        ids: list[int] = []
        slots: list[int] = []
        loading: list[Fence] = []
        for block in blocks:
            if (fence := self._still_loading(block.block_id, forget=True)) is not None:
                loading.append(fence)
            key = block.block_hash
            if key is None:
                continue
            slot = self.tier.admit(key)
            if slot is not None:
                ids.append(block.block_id)
                slots.append(slot)
        self.counters.spilled_blocks += len(ids)
        if before_reuse:
            self._pending_spills.extend(zip(ids, slots))
            return None
        if ids:
            self.counters.spill_batches += 1
            loading.append(self.copier.store(ids, slots))
        return AllFences(loading) if loading else None

    def _still_loading(self, block_id: int, *, forget: bool = False) -> Fence | None:
        """The fence of a load ahead into ``block_id`` not known to be done; compute will follow it."""
        self._unused_ahead.discard(block_id)
        entry = self._loading.pop(block_id, None) if forget else self._loading.get(block_id)
        if entry is None or entry[1].is_done():
            return None
        if self._compute_after is None or entry[0] > self._compute_after[0]:
            self._compute_after = entry  # one stream: following the latest batch follows them all
        return entry[1]

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
        slot = self._register(block, key)
        if slot is None:  # pragma: no cover - checked just above
            return None
        self._pending_loads.append((block.block_id, slot))
        return block

    def _register(self, block: Any, key: Hashable) -> int | None:
        """Put ``block`` in the prefix map under ``key`` as a free cached block; the host slot to load."""
        slot = self.tier.lookup(key)
        if slot is None:
            self.queue.append(block)
            return None
        if hasattr(block, "set_block_hash"):
            block.set_block_hash(key)
        else:  # older vLLM: a plain attribute
            block.block_hash = key
        self.block_pool.cached_block_hash_to_block.insert(key, block)
        self.queue.append(block)  # a free, cached block, as if it had never left
        return slot

    def matched(self, block: Any) -> None:
        """The scheduler found ``block`` in the GPU prefix cache this step: never evict it for a load."""
        self._matched.add(block.block_id)
        self._still_loading(block.block_id)

    # --------------------------------------------------------------- prefetch
    def prefetch(self, prefixes: Iterable[Sequence[Hashable]], budget: int) -> int:
        """Start loading the host-held blocks of ``prefixes`` (keys in order, one sequence per request).

        Each prefix is walked until its first block that neither the GPU nor
        the host holds. At most ``budget`` blocks are loaded. Their GPU blocks
        come from free memory or, failing that, from the least recently used
        cached blocks, never from blocks of the prefixes walked so far nor
        from blocks loaded ahead and not yet used. The loads run beside
        compute. Returns the number of blocks loaded.
        """
        if budget <= 0 or self.gpu_lookup is None:
            return 0
        loads: list[tuple[int, int]] = []
        protected = set(self._unused_ahead)
        for keys in prefixes:
            if not self._walk(keys, protected, loads, budget):
                break
        if not loads:
            return 0
        self._issue_spills(block_compute=False)  # the victims' copies first: one stream keeps the order
        number = next(self._batches)
        fence = self.copier.load([b for b, _ in loads], [s for _, s in loads], block_compute=False)
        for block_id, _ in loads:
            self._loading[block_id] = (number, fence)
            self._unused_ahead.add(block_id)
        self.counters.prefetched_blocks += len(loads)
        self.counters.reloaded_blocks += len(loads)
        self.counters.load_batches += 1
        return len(loads)

    def _walk(self, keys: Sequence[Hashable], protected: set[int], loads: list[tuple[int, int]],
              budget: int) -> bool:
        """Queue the loads of one prefix; False once the budget or the free blocks run out.

        The prefix's blocks still on the GPU are protected first, so loading
        its front never evicts its back.
        """
        lookup = self.gpu_lookup
        assert lookup is not None
        missing: list[Hashable] = []
        for key in keys:
            block = lookup(key)
            if block is not None:
                protected.add(block.block_id)
            elif key in self.tier:
                missing.append(key)
            else:
                break
        for key in missing:
            if len(loads) >= budget:
                return False
            block = self.queue.take_block_for_load(protected | self._matched)
            if block is None:
                return False
            protected.add(block.block_id)
            slot = self._register(block, key)
            if slot is not None:
                loads.append((block.block_id, slot))
        return True

    @property
    def unused_ahead(self) -> int:
        """Blocks loaded ahead that no request has matched yet."""
        return len(self._unused_ahead)

    # ------------------------------------------------------------------ steps
    def flush(self) -> None:
        """Issue the step's spills, then its loads, each as one batch (in that order on one stream)."""
        self._matched.clear()
        self._issue_spills(block_compute=True)
        if self._pending_loads:
            ids = [b for b, _ in self._pending_loads]
            slots = [s for _, s in self._pending_loads]
            self._pending_loads.clear()
            self.copier.load(ids, slots)
            self.counters.reloaded_blocks += len(ids)
            self.counters.load_batches += 1
        if self._compute_after is not None:
            self.copier.order_compute_after(self._compute_after[1])
            self._compute_after = None
        self._forget_done_loads()

    def _issue_spills(self, *, block_compute: bool) -> None:
        if not self._pending_spills:
            return
        ids = [b for b, _ in self._pending_spills]
        slots = [s for _, s in self._pending_spills]
        self._pending_spills.clear()
        self.copier.store(ids, slots, block_compute=block_compute)
        self.counters.spill_batches += 1

    def _forget_done_loads(self) -> None:
        done: dict[int, bool] = {}
        for block_id, (number, fence) in list(self._loading.items()):
            if done.setdefault(number, fence.is_done()):
                del self._loading[block_id]

    def reset(self) -> None:
        """vLLM reset its prefix cache (new weights, say): drop the host copies too.

        Loads ahead are waited for first: their blocks may now be released as
        plain free memory, and must not be unmapped under a running copy.
        """
        self.flush()
        for _, fence in list(self._loading.values()):
            fence.wait()
        self._loading.clear()
        self._unused_ahead.clear()
        self.tier.clear()

    def stats(self) -> dict[str, Any]:
        t = self.tier.stats()
        block = self.copier.bytes_per_block
        return {"host_slots": t.slots, "host_bytes_used": t.bytes_used, "host_hits": t.hits,
                "host_misses": t.misses, "arc_p": t.arc_p, "spilled_bytes": self.counters.spilled_blocks * block,
                "reloaded_bytes": self.counters.reloaded_blocks * block,
                "prefetched_bytes": self.counters.prefetched_blocks * block,
                "spill_batches": self.counters.spill_batches, "load_batches": self.counters.load_batches}
