"""Putting physical pages at their virtual addresses: contiguous runs, and which pages read as zero.

The pool decides which pages a group needs and keeps the books; this module
makes the backend calls for one batch of pages. Pages that follow each other
in one region go to the backend as one :class:`MapRun` (one access call and one
zero-fill each on CUDA). The zero policy says which pages must read as zero
once mapped: every page (``True``, torch.zeros semantics), none (``False``), or
only pages this pool never mapped before (``"fresh"``: a recycled page keeps
the pool's own old data, as a reused vLLM block does).

A zero-fill is queued on the device and not waited for, so a page may be
unmapped before its fill ran: on CUDA the fill then writes to an unmapped
address and the context dies (CUDA_ERROR_ILLEGAL_ADDRESS, seen on an H200 when
a warm reserve was trimmed right after it grew beside busy kernels). The placer
records a fence behind each batch of fills and an unmap of a page whose fill
may still be queued waits for it: at most the work queued before the fill.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kvelastic.errors import PoolError
from kvelastic.pool.backend import MapRun, PhysicalBackend
from kvelastic.pool.fenced_unmaps import FencedUnmaps
from kvelastic.pool.layout import PageRef

ZERO_POLICIES = (True, False, "fresh")


class PagePlacer:
    """Maps and unmaps batches of pages through the backend, zeroing as the policy says."""

    def __init__(self, backend: PhysicalBackend, page_bytes: int, zero_on_map: bool | str,
                 page_address: Callable[[PageRef], int]):
        """``page_address(ref)``: where page ``ref`` lives (its region must exist)."""
        if zero_on_map not in ZERO_POLICIES:
            raise PoolError(f"zero_on_map must be True, False or 'fresh', not {zero_on_map!r}")
        self.backend = backend
        self.page_bytes = page_bytes
        self.zero_on_map = zero_on_map
        self._page_address = page_address
        self._zeroed: set[Any] = set()  # "fresh": handles this pool has mapped (and zeroed) before
        self._filling = FencedUnmaps()  # pages whose zero-fill may still be queued on the device

    def map(self, refs: Sequence[PageRef], handles: Sequence[Any]) -> None:
        """Map ``handles[i]`` at ``refs[i]``; all or nothing."""
        if self.zero_on_map != "fresh":
            zero = bool(self.zero_on_map)
            self.backend.map_runs(self._runs(refs, handles), self.page_bytes, zero=zero)
            if zero:
                self._note_fills(refs)
            return
        new = [(r, h) for r, h in zip(refs, handles) if h not in self._zeroed]
        old = [(r, h) for r, h in zip(refs, handles) if h in self._zeroed]
        new_refs, new_handles = [r for r, _ in new], [h for _, h in new]
        self.backend.map_runs(self._runs(new_refs, new_handles), self.page_bytes, zero=True)
        self._note_fills(new_refs)
        try:
            self.backend.map_runs(self._runs([r for r, _ in old], [h for _, h in old]), self.page_bytes,
                                  zero=False)
        except BaseException:
            self.unmap(new_refs, new_handles)
            raise
        self._zeroed.update(new_handles)

    def unmap(self, refs: Sequence[PageRef], handles: Sequence[Any]) -> None:
        """Unmap the pages at ``refs`` once no zero-fill of theirs is queued; the pages themselves survive."""
        for fence in self._filling.fences_of(refs):
            fence.wait()
        self._filling.revive(refs)
        self._unmap_runs(self._runs(refs, handles))

    def _note_fills(self, refs: Sequence[PageRef]) -> None:
        """A fence behind the fills just queued for ``refs``; fills already passed are forgotten."""
        if not refs:
            return
        self._filling.ready(wait=False)
        self._filling.add(self.backend.record_fence(), list(refs))

    def forget(self, handles: list[Any]) -> None:
        """These pages were destroyed: a new page may come back under one of their handles."""
        self._zeroed.difference_update(handles)

    def _unmap_runs(self, runs: list[MapRun]) -> None:
        for run in runs:
            self.backend.unmap(run.address, len(run.handles) * self.page_bytes)

    def _runs(self, refs: Sequence[PageRef], handles: Sequence[Any]) -> list[MapRun]:
        """Coalesce pages into runs of consecutive pages in one region."""
        runs: list[MapRun] = []
        start: PageRef | None = None
        batch: list[Any] = []
        for ref, handle in sorted(zip(refs, handles), key=lambda item: item[0]):
            if start is not None and ref.region == start.region and ref.page == start.page + len(batch):
                batch.append(handle)
                continue
            if start is not None:
                runs.append(MapRun(self._page_address(start), tuple(batch)))
            start, batch = ref, [handle]
        if start is not None:
            runs.append(MapRun(self._page_address(start), tuple(batch)))
        return runs
