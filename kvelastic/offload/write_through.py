"""Write-through: which computed blocks to store to the host, when, and what a reuse must wait for.

vLLM names a block full in ``BlockPool.cache_full_blocks`` while it schedules
the step whose forward pass writes the block's last tokens: the data does not
exist yet. Issuing its copy at the end of that same ``schedule()`` would be
wrong even though the copier orders each copy after the work queued on the
legacy default stream: the step's forward pass is queued only after
``schedule()`` returns, so the copy would race it. The copy is issued
:data:`DELAY_STEPS` scheduling steps later instead:

* one step later is enough wherever the forward pass of step N is queued
  before step N+1 is scheduled: the synchronous engine loop, vLLM's
  uniprocess executor with async scheduling (it runs ``execute_model`` in the
  engine's thread), and tensor parallelism (a rank applies step N+1's
  commands only after it queued step N);
* two steps later holds however the executor dispatches: with async
  scheduling vLLM's batch queue holds at most two steps, so step N+2 is
  scheduled only after step N's output came back, i.e. after its forward
  pass ran. The cost is a block freed and evicted within two steps of its
  computation, which is copied at eviction, as without write-through.

Stores never make compute wait. Only a block reused while a store still reads
it needs a fence: the manager makes the step's compute wait for the copy
stream (one event; a step that spills or loads synchronously already waits for
it). Every fence covers all copies issued before it, so the stores in flight
are tracked only since the last one.

Where the copier has a second stream (``beside``) the stores run there
(:mod:`~kvelastic.offload.side_stores`), so the copy stream's loads never
queue behind them. Then a step's loads cover no store, and the copy stream
itself must wait for a store it would race: a load into a block a store still
reads, a load or spill of a slot a store still writes (:meth:`stores_touching`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Iterable, NamedTuple, Sequence

from kvelastic.offload.store_ahead import AheadCopies
from kvelastic.pool.backend import Fence

#: Scheduling steps between the one that names a block full and the one whose end issues its copy.
DELAY_STEPS = 2
#: The most bytes of stores issued per scheduling step, oldest first: a burst of computed blocks (a long
#: prefill) goes out over several steps, each about 11 ms of the link at 48 GB/s.
STEP_BYTES = 512 * 1024 * 1024
#: One slot of the host tier in ``AHEAD_SHARE`` is kept for copies of blocks still on the GPU (made ahead);
#: the policy keeps what left the GPU in the rest, and an eviction promotes its block's copy made ahead.
AHEAD_SHARE = 4


def ahead_slots(slots: int) -> int:
    """Slots of a tier of ``slots`` kept for copies made ahead: :data:`AHEAD_SHARE` of it, always leaving
    the policy at least one."""
    return max(0, min(slots - 1, slots // AHEAD_SHARE))


class Due(NamedTuple):
    block: Any
    key: Hashable
    step: int  # the step whose forward pass completes the block's data


class WriteThrough:
    """Blocks waiting for their store, and the stores still reading GPU blocks since the last fence."""

    def __init__(self, ahead: AheadCopies, bytes_per_block: int, *, beside: bool = False,
                 step_bytes: int = STEP_BYTES):
        """``beside``: the stores run on a stream of their own, which a step's loads do not cover;
        ``step_bytes``: the most bytes of stores issued per step."""
        self.ahead = ahead
        self.beside = beside
        self.step = 0  # scheduling steps completed
        self.max_blocks_per_step = max(1, step_bytes // max(1, bytes_per_block))
        self.fence_needed = False  # a block some store still reads was reused: compute must wait
        self.copy_waits = 0  # beside: copy-stream batches that waited for a store they would race
        self._due: OrderedDict[int, Due] = OrderedDict()  # by block id, oldest first
        self._reading: dict[int, Fence] = {}  # block id -> fence of the store reading it
        self._writing: dict[int, Fence] = {}  # host slot -> fence of the store writing it
        self._batches: list[tuple[Fence, list[int], list[int]]] = []  # (fence, block ids, slots)

    # ------------------------------------------------------------ scheduler side
    def computed(self, blocks: Iterable[Any]) -> None:
        """``cache_full_blocks`` named ``blocks``: their data is complete after this step's forward pass."""
        step = self.step + 1
        for block in blocks:
            key = block.block_hash
            if key is None or getattr(block, "is_null", False):
                continue
            bid = block.block_id
            if self.ahead.key_of_block(bid) not in (None, key):
                self.ahead.forget_block(bid)  # its hash changed: the copy made ahead is stale
            self._due.pop(bid, None)
            self._due[bid] = Due(block, key, step)

    def leaving(self, block: Any, *, before_reuse: bool) -> Fence | None:
        """``block`` leaves the GPU: it needs no store any more; the fence of a store still reading it, if any.

        ``before_reuse``: the block is overwritten by this step's compute, which
        must then wait (:attr:`fence_needed`); otherwise (its group is unmapped)
        the fence is returned for the unmap to wait for.
        """
        bid = block.block_id
        self._due.pop(bid, None)
        fence = self._reading.get(bid)
        if fence is None or fence.is_done():
            return None
        if before_reuse:
            self.fence_needed = True
            return None
        return fence

    def dropped(self, block_ids: Iterable[int]) -> None:
        """vLLM dropped these blocks' hashes (their data is not to be trusted): no store, no copy kept."""
        for bid in block_ids:
            self._due.pop(bid, None)
            self.ahead.forget_block(bid)
            if bid in self._reading:
                self.fence_needed = True  # the block may be reused without passing through eviction

    def reset(self) -> None:
        """vLLM reset its prefix cache: nothing is due; blocks still read by a store may be reused at once."""
        self._due.clear()
        if self._reading:
            self.fence_needed = True

    # ------------------------------------------------------------- issuing
    def take_due(self) -> tuple[list[int], list[int]]:
        """End of a scheduling step: the blocks to store now and the slots reserved for them (at most the cap)."""
        self.step += 1
        self._prune()
        ids: list[int] = []
        slots: list[int] = []
        while self._due and len(ids) < self.max_blocks_per_step:
            bid, due = next(iter(self._due.items()))
            if due.step + DELAY_STEPS > self.step:
                break  # later records were made no earlier
            if due.block.block_hash != due.key or not self.ahead.wants(due.key):
                del self._due[bid]  # rehashed meanwhile, or the tier holds the key already
                continue
            slot = self.ahead.place(due.key, bid)
            if slot is None:
                break  # no free slot: try again after evictions made room
            del self._due[bid]
            ids.append(bid)
            slots.append(slot)
        return ids, slots

    def issued(self, block_ids: list[int], slots: list[int], fence: Fence) -> None:
        """The stores of ``block_ids`` into ``slots`` are queued; ``fence`` passes when they are done."""
        for bid in block_ids:
            self._reading[bid] = fence
        for slot in slots:
            self._writing[slot] = fence
        self._batches.append((fence, block_ids, slots))

    def stores_touching(self, blocks_written: Sequence[int], slots: Sequence[int]) -> list[Fence]:
        """The fences of stores still in flight that a copy writing ``blocks_written`` and reading or
        writing ``slots`` would race: stores reading those blocks, or writing those slots."""
        if not self._batches:
            return []
        self._prune()
        found: dict[int, Fence] = {}
        for bid in blocks_written:
            if (fence := self._reading.get(bid)) is not None:
                found[id(fence)] = fence
        for slot in slots:
            if (fence := self._writing.get(slot)) is not None:
                found[id(fence)] = fence
        return list(found.values())

    def fenced(self) -> None:
        """Compute queued from now on waits for every copy issued so far: no store is a hazard any more
        (the copy stream's and the side stores' batches all start after some later compute)."""
        self._reading.clear()
        self._writing.clear()
        self._batches.clear()
        self.fence_needed = False

    @property
    def due_blocks(self) -> int:
        return len(self._due)

    @property
    def reading_blocks(self) -> int:
        return len(self._reading)

    def _prune(self) -> None:
        """Forget stores that are known done (in this process; a rank's are never known here)."""
        while self._batches and self._batches[0][0].is_done():
            fence, ids, slots = self._batches.pop(0)
            for bid in ids:
                if self._reading.get(bid) is fence:
                    del self._reading[bid]
            for slot in slots:
                if self._writing.get(slot) is fence:
                    del self._writing[slot]
