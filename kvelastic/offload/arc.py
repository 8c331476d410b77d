"""Adaptive Replacement Cache, as in Megiddo & Modha, FAST '03.

Why ARC for host-side KV blocks: prefix-cache traffic mixes a hot working set
(system prompts, popular prefixes) with one-time sequences that are touched
once and never again. LRU lets a burst of one-time blocks flush the hot set;
ARC keeps recency (T1) and frequency (T2) apart, remembers recently evicted
keys as ghosts (B1, B2) and moves its target size ``p`` for T1 towards
whichever list the ghost hits say was too small.

Without pins and without ``remove`` the behaviour is the paper's pseudo-code,
step for step: cases I-IV, ``p`` adapted by ``max(1, |B2|/|B1|)`` on a B1 hit
and ``max(1, |B1|/|B2|)`` on a B2 hit using real division, and REPLACE's rule
"evict from T1 if |T1| >= 1 and (|T1| > p or (x in B2 and |T1| == p)), else
from T2". Lists are ordered dicts, least recently used first, so every step is
O(1). The test suite checks this against a literal list-based transcription.

Where this class departs from the paper, and only there:

1. **Pins.** Whenever the paper names a victim — the LRU key of T1 or T2 in
   REPLACE, or the LRU key of T1 in case IV(A) when |T1| == c — pinned keys are
   skipped and the least recently used *unpinned* key of that list is taken.
   If REPLACE's chosen list holds only pinned keys, the LRU unpinned key of the
   other list is evicted instead (into that list's own ghost list). If no
   pinned key would have been the paper's victim, nothing differs.
2. **All pinned.** If a non-resident key is requested while the cache is full
   and every resident key is pinned, :class:`AllPinnedError` is raised before
   ``p`` or any list changes.
3. **remove().** It drops a resident key from T1/T2 without making a ghost,
   which leaves a free frame. REPLACE is therefore run only when the cache is
   full. In the paper the cache is always full when REPLACE runs (ghosts exist
   only once |T1|+|T2| == c), so this guard changes nothing unless ``remove``
   was used; ghost bookkeeping (deleting the LRU of B1 or B2) is unchanged.

Every deviation preserves the paper's invariants: |T1|+|B1| <= c,
|T1|+|T2|+|B1|+|B2| <= 2c and |T1|+|T2| <= c.

``on_evict`` is called after the request's state update is complete, so a
callback may safely inspect the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterator

from kvelastic.offload.policy import AllPinnedError, EvictCallback, PinnedPolicy

_NO_KEY = object()  # "no victim": keys may legitimately be None


@dataclass(frozen=True)
class ARCState:
    """A copy of ARC's state; each list is ordered least recently used first."""

    p: float
    t1: tuple[Hashable, ...]
    t2: tuple[Hashable, ...]
    b1: tuple[Hashable, ...]
    b2: tuple[Hashable, ...]


class ARC(PinnedPolicy):
    """ARC over ``capacity`` resident keys, with pins, removal and an evict callback."""

    def __init__(self, capacity: int, on_evict: EvictCallback = None) -> None:
        super().__init__(capacity, on_evict)
        self._p = 0.0
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()

    # ------------------------------------------------------------------ views

    @property
    def p(self) -> float:
        """Target size of T1, a real number in [0, capacity]."""
        return self._p

    @property
    def t1_size(self) -> int:
        return len(self._t1)

    @property
    def t2_size(self) -> int:
        return len(self._t2)

    @property
    def b1_size(self) -> int:
        return len(self._b1)

    @property
    def b2_size(self) -> int:
        return len(self._b2)

    def grow(self, capacity: int) -> None:
        """A larger c keeps every invariant (each bound only loosens) and p stays within [0, c]."""
        super().grow(capacity)

    def snapshot(self) -> ARCState:
        """Copy of ``p`` and the four lists, for tests and debugging (O(c))."""
        return ARCState(self._p, tuple(self._t1), tuple(self._t2), tuple(self._b1), tuple(self._b2))

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def resident_keys(self) -> Iterator[Hashable]:
        return iter((*self._t1, *self._t2))

    # ---------------------------------------------------------------- removal

    def _drop(self, key: Hashable) -> bool:
        for resident in (self._t1, self._t2):
            if key in resident:
                del resident[key]
                return True
        return False

    # ---------------------------------------------------------------- request

    def request(self, key: Hashable) -> bool:
        # Case I: hit in T1 or T2 -> MRU of T2.
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
            return True
        if key in self._t2:
            self._t2.move_to_end(key)
            return True
        if self._is_full() and len(self._pins) >= self._c:
            raise AllPinnedError(f"cannot admit {key!r}: all {self._c} resident keys are pinned")
        if key in self._b1:
            victim = self._ghost_hit_b1(key)
        elif key in self._b2:
            victim = self._ghost_hit_b2(key)
        else:
            victim = self._admit_new(key)
        if victim is not _NO_KEY and self._on_evict is not None:
            self._on_evict(victim)
        return False

    def _is_full(self) -> bool:
        return len(self._t1) + len(self._t2) >= self._c

    def _ghost_hit_b1(self, key: Hashable) -> object:
        """Case II: B1 was too small a history, so grow T1's target."""
        delta = max(1.0, len(self._b2) / len(self._b1))
        self._p = min(float(self._c), self._p + delta)
        victim = self._replace(in_b2=False) if self._is_full() else _NO_KEY
        del self._b1[key]
        self._t2[key] = None
        return victim

    def _ghost_hit_b2(self, key: Hashable) -> object:
        """Case III: B2 was too small a history, so shrink T1's target."""
        delta = max(1.0, len(self._b1) / len(self._b2))
        self._p = max(0.0, self._p - delta)
        victim = self._replace(in_b2=True) if self._is_full() else _NO_KEY
        del self._b2[key]
        self._t2[key] = None
        return victim

    def _admit_new(self, key: Hashable) -> object:
        """Case IV: a key in none of the four lists goes to MRU of T1."""
        victim: object = _NO_KEY
        c = self._c
        l1 = len(self._t1) + len(self._b1)
        if l1 == c:  # IV(A)
            if len(self._t1) < c:
                self._b1.popitem(last=False)
                if self._is_full():
                    victim = self._replace(in_b2=False)
            else:  # B1 is empty and T1 fills the cache: evict for real, no ghost.
                victim = self._lru_unpinned(self._t1)
                del self._t1[victim]
        else:  # IV(B): l1 < c
            total = l1 + len(self._t2) + len(self._b2)
            if total >= c:
                if total == 2 * c:
                    self._b2.popitem(last=False)
                if self._is_full():
                    victim = self._replace(in_b2=False)
        self._t1[key] = None
        return victim

    def _replace(self, in_b2: bool) -> object:
        """REPLACE: move one resident key to its ghost list and return it."""
        t1_len = len(self._t1)
        from_t1 = t1_len >= 1 and (t1_len > self._p or (in_b2 and t1_len == self._p))
        order = [(self._t1, self._b1), (self._t2, self._b2)]
        if not from_t1:
            order.reverse()
        for resident, ghosts in order:
            victim = self._lru_unpinned(resident)
            if victim is not _NO_KEY:
                del resident[victim]
                ghosts[victim] = None
                return victim
        # request() refuses up front when every resident key is pinned.
        raise AllPinnedError("internal: REPLACE found no unpinned key")

    def _lru_unpinned(self, resident: OrderedDict[Hashable, None]) -> object:
        """Least recently used key of ``resident`` that holds no pin.

        O(1) without pins; otherwise it walks past the pinned keys at the LRU
        end, which are few (one per in-flight copy).
        """
        if not self._pins:
            return next(iter(resident), _NO_KEY)
        for key in resident:
            if key not in self._pins:
                return key
        return _NO_KEY
