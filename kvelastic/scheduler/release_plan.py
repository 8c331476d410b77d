"""Which running requests to preempt so that whole page groups empty at once (``KVELASTIC_RELEASE=preempt``).

An engine over its limit gives back a page group only when none of its blocks
is in use. Waiting for its requests to finish took 3-5 s at p95 on an H100
(docs/multi-instance.md); preempting exactly the requests that hold blocks in
the chosen groups empties them within a step, at the price of recomputing
those requests (their prefix blocks stay cached or go to the host tier).

This module sees block ids and reference counts only, no vLLM object: the
hook (``kvelastic/hooks/targeted_release.py``) reads them from vLLM and
preempts what it returns. The choice, greedy:

* a group is a candidate only if every reference to each of its in-use
  blocks belongs to a running request (a block that a waiting request, a
  loading request or a connector also holds cannot be freed by preemption);
* each round takes the candidate that adds the fewest requests not already
  chosen, the higher group first on a tie (the free queue hands out low
  blocks first, so high groups are the ones to empty);
* never more than ``max_victims`` requests in all.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence


def choose_victims(blocks_of: Mapping[str, Sequence[int]], ref_cnt: Callable[[int], int],
                   group_of: Callable[[int], int], groups_wanted: int, max_victims: int) -> list[str]:
    """The requests (ids from ``blocks_of``, a running request's block ids) to preempt so that up to
    ``groups_wanted`` groups hold no block in use; in ``blocks_of``'s order. Empty if none can be had."""
    holders: dict[int, set[str]] = {}  # group -> running requests holding a block in it
    holds: dict[int, int] = {}  # block -> running requests holding it
    for request, blocks in blocks_of.items():
        for block in set(blocks):
            holds[block] = holds.get(block, 0) + 1
            holders.setdefault(group_of(block), set()).add(request)
    blocked = {group_of(block) for block, count in holds.items() if ref_cnt(block) > count}
    candidates = {g: h for g, h in holders.items() if g not in blocked}
    chosen: set[str] = set()
    for _ in range(groups_wanted):
        if not candidates:
            break
        group = min(candidates, key=lambda g: (len(candidates[g] - chosen), -g))
        added = candidates.pop(group) - chosen
        if len(chosen) + len(added) > max_victims:
            break
        chosen |= added
    return [request for request in blocks_of if request in chosen]
