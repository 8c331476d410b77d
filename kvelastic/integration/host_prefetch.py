"""Load the host-held prefixes of the requests next in line while the current step computes.

A prefix hit served by the host tier is loaded in front of the forward pass
that needs it, and that pass waits. When a burst of requests arrives (every
conversation's next turn at once, say), most of them wait in vLLM's queue for
a step or more anyway; their prefixes can come back during the steps before
theirs. After each scheduling step this walks the waiting queue in order and
loads up to a byte budget of host-held blocks, beside the step's compute.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Hashable, Iterator, Sequence

log = logging.getLogger("kvelastic")

#: Waiting requests looked at per step; beyond the budget the walk stops anyway.
MAX_REQUESTS = 256
#: Blocks loaded ahead and still unused may hold this many steps' budgets.
UNUSED_BUDGETS = 2


class HostPrefetch:
    """Runs after each scheduling step of one engine with a host tier."""

    def __init__(self, scheduler: Any, manager: Any, budget_blocks: int,
                 key_of: Callable[[Any], Hashable]):
        self.scheduler = scheduler
        self.manager = manager
        self.budget_blocks = budget_blocks
        self.key_of = key_of

    def __call__(self) -> int:
        room = UNUSED_BUDGETS * self.budget_blocks - self.manager.unused_ahead
        budget = min(self.budget_blocks, room)
        if budget <= 0:
            return 0
        waiting = itertools.islice(self.scheduler.waiting, MAX_REQUESTS)
        return self.manager.prefetch(self._prefixes(waiting), budget)

    def _prefixes(self, requests: Iterator[Any]) -> Iterator[Sequence[Hashable]]:
        for request in requests:
            hashes = getattr(request, "block_hashes", None) or ()
            yield [self.key_of(h) for h in hashes]


def make_host_prefetch(scheduler: Any, manager: Any, budget_bytes: int) -> HostPrefetch | None:
    """The prefetch for ``scheduler``, or None when off or when the model has several KV cache groups."""
    if budget_bytes <= 0:
        return None
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None)
    if groups is None or len(groups) != 1:
        log.info("kvelastic: host-tier prefetch off: it handles one KV cache group, this model has %s",
                 "unknown" if groups is None else len(groups))
        return None
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    blocks = max(1, budget_bytes // manager.copier.bytes_per_block)
    return HostPrefetch(scheduler, manager, blocks, lambda h: make_block_hash_with_group_id(h, 0))
