"""What the free queue owes vLLM between its block estimate and its allocation, until the step ends.

The commit guard (``kvelastic.hooks.commit_guard``) fills it in from vLLM's
estimate; the queue (``free_queue``) reads it. It lives in the core so the
queue needs nothing from the vLLM-facing hooks.
"""

from __future__ import annotations


class AllocationHold:
    """What the queue must honour between vLLM's estimate and its allocation, until the step ends."""

    def __init__(self) -> None:
        self.secured = 0         # blocks vLLM was just told it may take; empty groups stay mapped for them
        self.refused = False     # the device refused this step: promise no unmapped group until it ends

    def taken(self, blocks: int) -> None:
        self.secured = max(0, self.secured - blocks)

    def end_step(self) -> None:
        self.secured = 0
        self.refused = False
