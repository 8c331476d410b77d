"""Write-through's stores on a stream of their own, and the waits every other copy owes them.

On one copy stream a step's loads, which its forward pass waits for, queue
behind the write-through stores issued before them: on an H200 loads behind
stores moved 32.0 GB/s, 48.0 without. So wherever the copier has a second
stream (:attr:`Copier.side_stores`) the stores go there
(:meth:`BlockCopier.store_beside`), which starts after the compute and the
copies queued before it; the copy stream then owes them a wait only where it
would race one, and this adaptor puts that wait in front of each of its
batches:

- a load into a block a store still reads (the block left the GPU, or its
  hash changed, while the store ran);
- a load from a slot a store still writes (its copy made ahead was promoted
  when the block was evicted, and is now being reloaded);
- a spill into a slot a store still writes (a slot given up by a copy made
  ahead, handed to the policy).

A spill reading a block a store also reads races nothing. Compute waits for the
stores only through :meth:`BlockCopier.fence_compute` (a reused block a store
still reads), which covers both streams. Like RMM's adaptors it wraps the
copier the caller built, and both the manager and the asynchronous loads copy
through it.
"""

from __future__ import annotations

from typing import Sequence

from kvelastic.offload.write_through import WriteThrough
from kvelastic.pool.backend import Fence
from kvelastic.roles import Copier


class SideStoreCopier(Copier):
    """``copier`` with write-through's stores beside its stream: each other batch first waits for the
    stores it would race (:meth:`WriteThrough.stores_touching`)."""

    side_stores = True

    def __init__(self, copier: Copier, write_through: WriteThrough):
        self.inner = copier
        self.write_through = write_through
        self.bytes_per_block = copier.bytes_per_block

    def store(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = False) -> Fence:
        self._after_stores((), slots)
        return self.inner.store(block_ids, slots, block_compute=block_compute)

    def load(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = True) -> Fence:
        self._after_stores(block_ids, slots)
        return self.inner.load(block_ids, slots, block_compute=block_compute)

    def store_beside(self, block_ids: Sequence[int], slots: Sequence[int]) -> Fence:
        """A write-through store, on the side stream."""
        return self.inner.store_beside(block_ids, slots)

    def wait_for(self, fences: Sequence[Fence]) -> None:
        self.inner.wait_for(fences)

    def fence_compute(self) -> None:
        self.inner.fence_compute()

    def copy_times(self) -> dict[str, float] | None:
        return self.inner.copy_times()

    def _after_stores(self, blocks_written: Sequence[int], slots: Sequence[int]) -> None:
        fences = self.write_through.stores_touching(blocks_written, slots)
        if fences:
            self.write_through.copy_waits += 1
            self.inner.wait_for(fences)
