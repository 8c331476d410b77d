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

A step's loads are split at :meth:`OffloadManager.flush`: blocks a scheduled
request holds are loaded in front of the step's forward pass, which waits for
them; blocks no request took this step (vLLM declined the request, or the load
pacer held it back a step, see ``integration/load_pacing.py``) load beside the
step's compute instead. Such a block is registered as cached at once, so
whatever touches it before its load is done (the scheduler matching it, a new
request reusing it, its group being unmapped) is ordered after the load's fence.
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
    background_blocks: int = 0
    spill_batches: int = 0
    load_batches: int = 0


class OffloadManager:
    """Moves cached blocks between one GPU block pool and one host tier."""

    def __init__(self, tier: HostTier, copier: BlockCopier, queue: Any, block_pool: Any, *,
                 background_loads: bool = False):
        self.tier = tier
        self.copier = copier
        self.queue = queue
        self.block_pool = block_pool
        self.counters = OffloadCounters()
        #: Loads of blocks no request took this step run beside compute (False: the copier cannot).
        self.background_loads = background_loads
        self.gpu_lookup: Callable[[Hashable], Any] | None = None  # the prefix map's own lookup (hook_lookup)
        self._pending_loads: dict[int, tuple[Any, int]] = {}  # block id -> (block, host slot)
        self._pending_spills: list[tuple[int, int]] = []
        self._matched: set[int] = set()  # blocks the scheduler matched this step
        self._loading: dict[int, tuple[int, Fence]] = {}  # block -> (batch, fence) of loads beside compute
        self._batches = itertools.count()
        self._compute_after: tuple[int, Fence] | None = None  # the latest such batch compute must follow

    # ------------------------------------------------------------------ spill
    def spill(self, blocks: Sequence[Any], *, before_reuse: bool) -> Fence | None:
        """Copy the cached ``blocks`` to the host tier.

        ``before_reuse``: the blocks are being handed to new requests in this
        scheduling step. Their copies are batched and issued at :meth:`flush`,
        before the step's compute, which then waits for them. Otherwise (a
        group is being released) the copy is issued now and the returned fence
        passes when it and any load still running into these blocks are done,
        so the group is unmapped only after them.
        """
        ids: list[int] = []
        slots: list[int] = []
        loading: list[Fence] = []
        for block in blocks:
            self._pending_loads.pop(block.block_id, None)  # reused before its load was issued: no load
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
        """The fence of a load beside compute into ``block_id`` not known to be done; compute will follow it."""
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
        self._pending_loads[block.block_id] = (block, slot)
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

    def load_queued(self, block_id: int) -> bool:
        """Whether this step has queued a load into ``block_id`` (issued at :meth:`flush`)."""
        return block_id in self._pending_loads

    def load_ahead(self, prefixes: Iterable[Sequence[Hashable]], budget: int) -> int:
        """Queue loads of the host-held blocks of ``prefixes`` (keys in order, one sequence per request).

        For requests that vLLM will schedule in a later step: no request holds
        these blocks now, so :meth:`flush` loads them beside the compute. Each
        prefix is walked up to its first block that neither the GPU nor the
        host holds; at most ``budget`` blocks are queued. Their GPU blocks come
        from free memory or the least recently used cached blocks, never from
        the walked prefixes' own blocks. Returns the blocks queued.
        """
        if budget <= 0 or self.gpu_lookup is None:
            return 0
        queued = 0
        protected = set(self._pending_loads)
        for keys in prefixes:
            missing = self._host_part(keys, protected)
            for key in missing:
                if queued >= budget:
                    return queued
                block = self.queue.take_block_for_load(protected | self._matched)
                if block is None:
                    return queued
                protected.add(block.block_id)
                slot = self._register(block, key)
                if slot is not None:
                    self._pending_loads[block.block_id] = (block, slot)
                    queued += 1
        return queued

    def _host_part(self, keys: Sequence[Hashable], protected: set[int]) -> list[Hashable]:
        """The keys of a prefix only the host holds; the GPU's blocks of it are added to ``protected``."""
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
        return missing

    # ------------------------------------------------------------------ steps
    def flush(self) -> None:
        """Issue the step's spills, then its loads (in that order on one stream).

        Loads into blocks a request holds go first, and the step's compute
        waits for them; the rest run beside the compute.
        """
        self._matched.clear()
        self._issue_spills(block_compute=True)
        pending = list(self._pending_loads.values())
        self._pending_loads.clear()
        background = [(b, s) for b, s in pending if self.background_loads and not b.ref_cnt]
        foreground = [(b, s) for b, s in pending if not (self.background_loads and not b.ref_cnt)]
        if foreground:
            self.copier.load([b.block_id for b, _ in foreground], [s for _, s in foreground])
            self.counters.load_batches += 1
        if background:
            self._load_beside_compute(background)
        self.counters.reloaded_blocks += len(pending)
        if self._compute_after is not None:
            self.copier.order_compute_after(self._compute_after[1])
            self._compute_after = None
        self._forget_done_loads()

    def _load_beside_compute(self, loads: list[tuple[Any, int]]) -> None:
        number = next(self._batches)
        fence = self.copier.load([b.block_id for b, _ in loads], [s for _, s in loads], block_compute=False)
        for block, _ in loads:
            self._loading[block.block_id] = (number, fence)
        self.counters.background_blocks += len(loads)
        self.counters.load_batches += 1

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

        Loads beside compute are waited for first: their blocks may now be
        released as plain free memory, and must not be unmapped under a copy.
        """
        self.flush()
        for _, fence in list(self._loading.values()):
            fence.wait()
        self._loading.clear()
        self.tier.clear()

    def stats(self) -> dict[str, Any]:
        t = self.tier.stats()
        block = self.copier.bytes_per_block
        return {"host_slots": t.slots, "host_bytes_used": t.bytes_used, "host_hits": t.hits,
                "host_misses": t.misses, "arc_p": t.arc_p, "spilled_bytes": self.counters.spilled_blocks * block,
                "reloaded_bytes": self.counters.reloaded_blocks * block,
                "background_bytes": self.counters.background_blocks * block,
                "spill_batches": self.counters.spill_batches, "load_batches": self.counters.load_batches}
