"""Hold part of a burst back a step when its host-tier loads would stall the whole step.

A prefix hit served by the host tier is loaded in front of the step's forward
pass, and every request in the step waits for that load. When a burst brings
back more history than the link moves in about one step (every conversation's
next turn arriving at once, say), the pacer lets the step's requests take host
loads up to a byte budget. The request whose loads would go past it is declined
for this step: its estimate is reported as unaffordable, so vLLM leaves it
waiting before changing anything. Its blocks, already registered, load beside
the step's compute (the offload manager loads every block no scheduled request
holds that way), and so do the host-held prefixes of the requests queued
behind it, up to the same budget. The next step finds them on the GPU. The
first request with host loads in a step is always admitted, so every request
makes progress.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Hashable, Iterator, Sequence

log = logging.getLogger("kvelastic")

#: What an estimate reports for a request held back: more blocks than any pool has.
HELD_BACK = 1 << 62
#: Waiting requests whose prefixes are walked after a step that held one back.
WALK_REQUESTS = 32


class LoadPacer:
    """Per scheduling step: host-served blocks admitted so far, and whether a request was held back."""

    def __init__(self, manager: Any, budget_blocks: int, waiting: Callable[[], Any],
                 key_of: Callable[[Any], Hashable]):
        self.manager = manager
        self.budget_blocks = budget_blocks
        self.waiting = waiting
        self.key_of = key_of
        self.held_back = 0  # requests declined for a step, over the engine's life
        self._admitted: set[int] = set()
        self._held_this_step = False

    def admit(self, new_computed_blocks: Sequence[Sequence[Any]] | None) -> bool:
        """Whether a request whose cache hit is ``new_computed_blocks`` (per KV group) may run this step."""
        mine = {b.block_id for group in new_computed_blocks or () for b in group
                if self.manager.load_queued(b.block_id) and b.block_id not in self._admitted}
        if not mine:
            return True
        if self._admitted and len(self._admitted) + len(mine) > self.budget_blocks:
            self._held_this_step = True
            self.held_back += 1
            return False
        self._admitted |= mine
        return True

    def end_step(self) -> None:
        """After a step that held a request back, queue loads for the requests behind it too."""
        if self._held_this_step:
            waiting = itertools.islice(self.waiting(), WALK_REQUESTS)
            self.manager.load_ahead(self._prefixes(waiting), self.budget_blocks)
        self._admitted.clear()
        self._held_this_step = False

    def _prefixes(self, requests: Iterator[Any]) -> Iterator[list[Hashable]]:
        for request in requests:
            yield [self.key_of(h) for h in getattr(request, "block_hashes", None) or ()]


def make_pacer(scheduler: Any, manager: Any, budget_bytes: int) -> LoadPacer | None:
    """The pacer of ``scheduler``'s host tier, or None when off or the model has several KV cache groups."""
    if budget_bytes <= 0 or not manager.background_loads:
        return None
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None)
    if groups is None or len(groups) != 1:
        log.info("kvelastic: host-load pacing off: it handles one KV cache group, this model has %s",
                 "unknown" if groups is None else len(groups))
        return None
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    blocks = max(1, budget_bytes // manager.copier.bytes_per_block)
    return LoadPacer(manager, blocks, lambda: scheduler.waiting, lambda h: make_block_hash_with_group_id(h, 0))
