"""Fences over CUDA events, for copies that run on the copier's own stream."""

from __future__ import annotations

from typing import Sequence

import torch

from kvelastic.pool.backend import Fence


class EventFence(Fence):
    """A torch CUDA event as a pool fence."""

    def __init__(self, event: "torch.cuda.Event"):
        self.event = event

    def is_done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class AllFences(Fence):
    """Passes when every fence in it has passed."""

    def __init__(self, fences: Sequence[Fence]):
        self.fences = list(fences)

    def is_done(self) -> bool:
        return all(f.is_done() for f in self.fences)

    def wait(self) -> None:
        for fence in self.fences:
            fence.wait()
