"""Least-recently-used replacement, the baseline ARC is measured against.

It implements the same :class:`EvictionPolicy` contract as ARC (pins, remove,
eviction callback), so the offload manager can run either and the hit-ratio
report compares like with like. A victim is the least recently used resident
key that holds no pin.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvelastic.offload.policy import (
    AllPinnedError,
    EvictCallback,
    EvictionPolicy,
    KeyPinnedError,
    NotResidentError,
    PinCounts,
    check_capacity,
)


class LRU(EvictionPolicy):
    """LRU over ``capacity`` resident keys, with pins, removal and an evict callback."""

    def __init__(self, capacity: int, on_evict: EvictCallback = None) -> None:
        self._c = check_capacity(capacity)
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # LRU first
        self._pins = PinCounts()
        self._on_evict = on_evict

    @property
    def capacity(self) -> int:
        return self._c

    def grow(self, capacity: int) -> None:
        self._c = max(self._c, check_capacity(capacity))

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def resident_keys(self) -> Iterator[Hashable]:
        """Resident keys, least recently used first (a snapshot)."""
        return iter(tuple(self._keys))

    def pin(self, key: Hashable) -> None:
        if key not in self._keys:
            raise NotResidentError(f"cannot pin {key!r}: not resident")
        self._pins.pin(key)

    def unpin(self, key: Hashable) -> None:
        self._pins.unpin(key)

    def is_pinned(self, key: Hashable) -> bool:
        return key in self._pins

    def remove(self, key: Hashable) -> bool:
        if key in self._pins:
            raise KeyPinnedError(f"cannot remove {key!r}: pinned")
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
