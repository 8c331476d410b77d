"""Pages whose unmap waits for a fence: the GPU may still read them.

A page group given back while kernels that use it are still queued keeps its
pages mapped, and counted, until the fence recorded behind those kernels
passes. A page asked for again before then is simply revived (its data is
still there). Fences are checked once per batch, not per page.

The placer keeps a second set of the same books: pages whose zero-fill may
still be queued, which no unmap may pull from under the fill.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from kvelastic.pool.backend import Fence
from kvelastic.pool.layout import PageRef


class FencedUnmaps:
    """Which pages wait on which fence, in the order they were given back."""

    def __init__(self) -> None:
        self._fence_of: dict[PageRef, Fence] = {}
        self._batches: deque[tuple[Fence, list[PageRef]]] = deque()

    def __len__(self) -> int:
        return len(self._fence_of)

    def __contains__(self, ref: object) -> bool:
        return ref in self._fence_of

    def add(self, fence: Fence, refs: list[PageRef]) -> None:
        """``refs`` are unmapped once ``fence`` passes (unless revived first)."""
        if not refs:
            return
        for ref in refs:
            self._fence_of[ref] = fence
        self._batches.append((fence, refs))

    def fences_of(self, refs: Iterable[PageRef]) -> list[Fence]:
        """The distinct fences that ``refs`` still wait on."""
        fences = {id(fence): fence for ref in refs if (fence := self._fence_of.get(ref)) is not None}
        return list(fences.values())

    def revive(self, refs: Iterable[PageRef]) -> None:
        """``refs`` are in use again (or unmapped by other means): they no longer wait."""
        for ref in refs:
            self._fence_of.pop(ref, None)

    def ready(self, wait: bool) -> list[PageRef]:
        """The pages whose fence has passed (every fence waited for if ``wait``); they no longer wait."""
        if not self._batches:
            return []
        ready: list[PageRef] = []
        waiting: deque[tuple[Fence, list[PageRef]]] = deque()
        for fence, refs in self._batches:
            if wait:
                fence.wait()
            if wait or fence.is_done():
                ready.extend(r for r in refs if self._fence_of.get(r) is fence)
            else:
                waiting.append((fence, refs))
        self._batches = waiting
        self.revive(ready)
        return ready

    def clear(self) -> None:
        self._fence_of.clear()
        self._batches.clear()
