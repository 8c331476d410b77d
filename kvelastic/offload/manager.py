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

A long run of host hits (a 16k-token prefix is 1,024 blocks, eight page
groups of the 8B engine) maps its groups one by one while vLLM looks the
blocks up, the engine thread waiting on the mapper each time. Where mapping is
synchronous (the cache in this process), the loads are therefore issued a
group's worth at a time as the lookups go on: the copy stream moves the blocks
of one group while the driver maps the next, instead of starting only once
every group is mapped; only once the run being looked up is
:data:`LONG_RUN_GROUPS` groups long: a step of many short runs (a multi-turn
batch) keeps one batched load, since each piece costs the engine thread its
launches and short runs wait on few maps. The data, and what compute waits for, are those of one batch at the
step's end (see :meth:`OffloadManager.load_on_miss`). The runs' lengths
(:mod:`~kvelastic.offload.host_runs`) also size the warm reserve for reloads.

With write-through (the cache in this process: :mod:`~kvelastic.offload.plan`) blocks are also
stored as they are computed, beside the compute (:mod:`~kvelastic.offload.write_through`);
an eviction then finds the copy made ahead and costs no copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol, Sequence

from kvelastic.offload.fences import AllFences
from kvelastic.offload.host_runs import HostRuns
from kvelastic.offload.host_tier import HostTier
from kvelastic.offload.write_through import WriteThrough
from kvelastic.pool.backend import Fence
from kvelastic.roles import Copier

#: A run of host hits this many page groups long is loaded a group at a time. On an H100 pieces reloaded a
#: 16k-token 8B prefix in 103-110 ms against 113-115 in one batch, and pieces within every run cost the 1B
#: multi-turn 6 %: its runs are shorter than a group.
LONG_RUN_GROUPS = 2


class TrafficPart(Protocol):
    """More of the host tier's traffic beside the manager's own: the asynchronous loads
    (``kvelastic/hooks/host_loads.py``)."""

    def issue(self) -> None:
        """End of ``schedule()``, after the step's spills and synchronous loads: issue what it planned."""

    def settle(self) -> None:
        """Before the host tier is cleared: wait for every copy that reads or writes its slots."""

    def stats(self) -> dict[str, Any]:
        """Its numbers; ``reloaded_blocks`` adds to the manager's own."""


@dataclass
class OffloadCounters:
    spilled_blocks: int = 0  # copied as they left the GPU
    reloaded_blocks: int = 0
    spill_batches: int = 0
    load_batches: int = 0
    stored_ahead_blocks: int = 0  # copied by write-through, beside the compute
    evicted_free: int = 0  # evictions that found their copy made ahead (no copy)
    store_fences: int = 0  # steps whose compute waited for a store only because its block was reused


class OffloadManager:
    """Moves cached blocks between one GPU block pool and one host tier.

    ``enter_block(block, key)`` gives a free block the hash ``key`` and enters
    it in the pool's prefix-cache map, the way the running vLLM release does
    (``kvelastic/hooks/offload_setup.py`` builds it). ``copier`` moves the
    bytes in this process, or sends each rank the command to move its shard.
    """

    def __init__(self, tier: HostTier, copier: Copier, queue: Any,
                 enter_block: Callable[[Any, Hashable], None], write_through: WriteThrough | None = None,
                 *, pieces: bool = False, runs: HostRuns | None = None):
        """``write_through``: store blocks as they are computed (None: only as they leave the GPU).
        ``pieces``: issue loads a page group at a time within a run of host hits :data:`LONG_RUN_GROUPS`
        groups long, where the queue maps synchronously. ``runs``: where the runs' lengths are kept (a
        fresh one if None)."""
        self.write_through = write_through
        self.tier = tier
        self.copier = copier
        self.queue = queue
        self.enter_block = enter_block
        self.counters = OffloadCounters()
        self._after_reset: list[Callable[[], None]] = []
        self._parts: list[TrafficPart] = []
        self._pending_loads: list[tuple[int, int]] = []
        self._pending_spills: list[tuple[int, int]] = []
        self._matched: set[int] = set()  # blocks the scheduler matched this step
        self.runs = runs if runs is not None else HostRuns()
        self._issue_every = _loads_per_piece(queue) if pieces else 0
        self._long_run = self._issue_every * LONG_RUN_GROUPS
        self._issued_early = False  # copies of this step issued before its end, not yet fenced (see flush)

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
        reading: list[Fence] = []  # write-through stores still reading blocks whose group is unmapped
        for block in blocks:
            key = block.block_hash
            if key is None:
                continue
            if self.write_through is not None:
                fence = self.write_through.leaving(block, before_reuse=before_reuse)
                if fence is not None:
                    reading.append(fence)
                if self.write_through.ahead.promote(key):
                    self.counters.evicted_free += 1
                    continue
            slot = self.tier.admit(key)
            if slot is not None:
                ids.append(block.block_id)
                slots.append(slot)
        if ids:
            self.counters.spilled_blocks += len(ids)
            if before_reuse:
                self._pending_spills.extend(zip(ids, slots))
            else:
                self.counters.spill_batches += 1
                reading.append(self.copier.store(ids, slots))
        if before_reuse or not reading:
            return None
        return reading[0] if len(reading) == 1 else AllFences(reading)

    # ----------------------------------------------------------------- reload
    def load_on_miss(self, key: Hashable) -> Any | None:
        """A GPU block now holding (or about to hold) ``key``'s data, or None on a host miss.

        Once a group's worth of loads is pending in a run long enough (see
        :meth:`_piece_due`), they are issued (after the pending spills, as
        :meth:`flush` orders them) before the next block is taken, which may
        wait for its group to be mapped: that copy overlaps the map. They do
        not make compute wait one by one; :meth:`flush` fences the copy stream
        once, after the last of them (one stream: all of them).
        """
        tier, queue = self.tier, self.queue  # once per block looked up: locals, not attributes
        if key not in tier:
            tier.misses += 1
            self.runs.end()
            return None
        if self._issue_every and self._piece_due():
            self._issued_early |= self._issue_pending(block_compute=False)
        block = queue.take_block_for_load(self._matched)
        if block is None:
            self.runs.end()
            return None
        self.runs.hit()
        block_id = block.block_id
        self._matched.add(block_id)
        slot = tier.lookup(key)
        if slot is None:  # pragma: no cover - checked just above
            queue.append(block)
            return None
        self.enter_block(block, key)
        queue.append(block)  # a free, cached block, as if it had never left
        self._pending_loads.append((block_id, slot))
        return block

    def _piece_due(self) -> bool:
        """Whether the pending loads go out now: a group's worth of them, in a run that is long enough."""
        return (bool(self._issue_every) and len(self._pending_loads) >= self._issue_every
                and self.runs.current >= self._long_run)

    def matched(self, block: Any) -> None:
        """The scheduler found ``block`` in the GPU prefix cache this step: never evict it for a load."""
        self._matched.add(block.block_id)
        self.runs.end()

    def flush(self) -> None:
        """Issue the pending spills, then loads, each as one batch (in that order on one stream).

        Both make later compute wait for the copy stream, so they also cover
        every write-through store issued before them; a reuse of a block a
        store still reads takes an explicit fence only when neither came.
        Copies issued earlier in the step (:meth:`load_on_miss`) are covered
        by the last batch's fence, or by one of their own when none is left.
        """
        self._matched.clear()
        self.runs.end()
        waited = self._issue_pending(block_compute=True)
        early, self._issued_early = self._issued_early, False
        wt = self.write_through
        covered = False  # whether compute now waits for every copy issued, write-through's stores too
        if waited:  # the loads' wait covers the copy stream, and the stores only where they share it
            covered = wt is None or not wt.beside
        elif early:
            self.copier.fence_compute()  # covers the side stores too
            covered = True
        if wt is not None and wt.fence_needed and not covered:
            self.copier.fence_compute()
            self.counters.store_fences += 1
            covered = True
        if wt is not None and covered:
            wt.fenced()

    def _issue_pending(self, *, block_compute: bool) -> bool:
        """Issue the pending spills, then the pending loads, each as one batch (``block_compute``: later
        compute waits for them); True if anything was issued."""
        issued = False
        if self._pending_spills:
            ids = [b for b, _ in self._pending_spills]
            slots = [s for _, s in self._pending_spills]
            self._pending_spills.clear()
            self.copier.store(ids, slots, block_compute=block_compute)
            self.counters.spill_batches += 1
            issued = True
        if self._pending_loads:
            ids = [b for b, _ in self._pending_loads]
            slots = [s for _, s in self._pending_loads]
            self._pending_loads.clear()
            self.copier.load(ids, slots, block_compute=block_compute)
            self.counters.reloaded_blocks += len(ids)
            self.counters.load_batches += 1
            issued = True
        return issued

    def join(self, part: TrafficPart) -> None:
        """``part`` issues its copies at each step's end right after :meth:`flush`, is settled before a
        reset, and reports its numbers with the manager's."""
        self._parts.append(part)

    def end_step(self) -> None:
        """End of ``schedule()``: :meth:`flush`, the joined parts' copies, then the write-through stores
        now due, beside compute.

        They go after the step's loads, so the loads (which compute waits for)
        do not queue behind them on the copy stream; a part's copies follow the
        spills, since a block being spilled may be a load's destination.
        """
        self.flush()
        for part in self._parts:
            part.issue()
        wt = self.write_through
        if wt is None:
            return
        ids, slots = wt.take_due()
        if not ids:
            return
        try:
            fence = (self.copier.store_beside(ids, slots) if wt.beside
                     else self.copier.store(ids, slots, block_compute=False))
        except BaseException:
            for bid in ids:  # never leave a slot claimed for a copy that was not queued
                wt.ahead.forget_block(bid)
            raise
        wt.issued(ids, slots, fence)
        self.counters.stored_ahead_blocks += len(ids)
        self.counters.spill_batches += 1

    def computed(self, blocks: Sequence[Any]) -> None:
        """vLLM named ``blocks`` full this step (write-through stores them once computed)."""
        if self.write_through is not None:
            self.write_through.computed(blocks)

    def dropped(self, block_ids: Sequence[int]) -> None:
        """vLLM dropped these blocks' hashes outside an eviction: no copy of their data may be kept."""
        if self.write_through is not None:
            self.write_through.dropped(block_ids)

    def on_reset(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after each :meth:`reset` (the lookup hook follows vLLM's new prefix map)."""
        self._after_reset.append(callback)

    def reset(self) -> None:
        """vLLM reset its prefix cache (new weights, say): drop the host copies too."""
        for part in self._parts:
            part.settle()
        if self.write_through is not None:
            self.write_through.reset()
        self.flush()
        self.tier.clear()
        if self.write_through is not None:
            self.write_through.ahead.clear()
        for callback in self._after_reset:
            callback()

    def stats(self) -> dict[str, Any]:
        """The tier's numbers and what moved; ``spilled_bytes`` counts every copy to the host, stored ahead too."""
        t, c, size = self.tier.stats(), self.counters, self.copier.bytes_per_block
        parts = [part.stats() for part in self._parts]
        reloaded = c.reloaded_blocks + sum(int(p.pop("reloaded_blocks", 0)) for p in parts)
        values = {"host_slots": t.slots, "host_pinned_bytes": t.slots * t.slot_bytes,
                  "host_bytes_used": t.bytes_used, "host_hits": t.hits,
                  "host_misses": t.misses, "arc_p": t.arc_p,
                  "spilled_bytes": (c.spilled_blocks + c.stored_ahead_blocks) * size,
                  "reloaded_bytes": reloaded * size, "spill_batches": c.spill_batches,
                  "load_batches": c.load_batches, "load_runs": self.runs.ended}
        values.update(self.copier.copy_times() or {})
        for part in parts:
            values.update(part)
        if self.write_through is not None:
            values.update(stored_ahead_bytes=c.stored_ahead_blocks * size, evicted_free=c.evicted_free,
                          store_fences=c.store_fences, ahead_held=len(self.write_through.ahead),
                          ahead_dropped=self.write_through.ahead.dropped)
            if self.write_through.beside:
                values["copy_waits"] = self.write_through.copy_waits
        return values


def _loads_per_piece(queue: Any) -> int:
    """How many loads of one step go out together ahead of the step's end: a page group's blocks where
    the queue maps synchronously (in this process), else none (0: all at the end, as under tensor
    parallelism, where the ranks apply a step's commands together anyway)."""
    return queue.cache.blocks_per_group if queue.mapper.synchronous else 0
