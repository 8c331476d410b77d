"""Least-recently-used replacement, the baseline ARC is measured against.

It implements the same :class:`EvictionPolicy` contract as ARC (pins, remove,
eviction callback), so the offload manager can run either and the hit-ratio
report compares like with like. A victim is the least recently used resident
key that holds no pin.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvelastic.offload.policy import AllPinnedError, EvictCallback, PinnedPolicy


class LRU(PinnedPolicy):
    """LRU over ``capacity`` resident keys, with pins, removal and an evict callback."""

    def __init__(self, capacity: int, on_evict: EvictCallback = None) -> None:
        super().__init__(capacity, on_evict)
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # LRU first

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def resident_keys(self) -> Iterator[Hashable]:
        """Resident keys, least recently used first (a snapshot)."""
        return iter(tuple(self._keys))

    def _drop(self, key: Hashable) -> bool:
        if key in self._keys:
            del self._keys[key]
            return True
        return False

    def request(self, key: Hashable) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        evicted = False
        victim: Hashable = None
        if len(self._keys) >= self._c:
            victim = self._lru_unpinned(key)
            del self._keys[victim]
            evicted = True
        self._keys[key] = None
        if evicted and self._on_evict is not None:
            self._on_evict(victim)
        return False

    def _lru_unpinned(self, incoming: Hashable) -> Hashable:
        """Least recently used unpinned key; :class:`AllPinnedError` if none."""
        for key in self._keys:
            if key not in self._pins:
                return key
        raise AllPinnedError(f"cannot admit {incoming!r}: all {self._c} resident keys are pinned")
