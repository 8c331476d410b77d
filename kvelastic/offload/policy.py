"""The contract every replacement policy of the offload cache fulfils.

The offload manager decides *what* to copy between GPU and host; a policy only
decides *which resident key leaves* when room is needed. Keeping that decision
behind one small interface lets the manager swap ARC for LRU (or a future
policy) and lets the tests run the same interface checks against every policy.

Two needs of the offload path shape the interface beyond a textbook cache:

* **Pins.** While a block is being copied its host slot must not be reused, so
  a pinned resident key is never chosen as a victim. Pins nest by count: two
  in-flight copies of the same key need two ``unpin`` calls. Nothing pins
  today: every copy of a host slot is queued on one stream, so stream order
  already keeps a reused slot from being overwritten under a copy still
  reading it. Pins are the fence for copies that outlive that order (stores
  beside compute on their own stream, loads a request waits for across steps:
  ``docs/offload.md``): pin a key when its copy is issued, unpin it when the
  copy's fence passes.
* **Eviction callback.** The manager frees the host slot of every key the
  policy evicts, so ``on_evict`` is called for each resident key the policy
  pushes out — but not for keys the caller drops itself with ``remove``, since
  the caller already knows about those.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Hashable, Iterator, Optional

from kvelastic.errors import KvelasticError

EvictCallback = Optional[Callable[[Hashable], None]]


class PolicyError(KvelasticError):
    """A replacement policy was used in a way its contract forbids."""


class InvalidCapacityError(PolicyError, ValueError):
    """The capacity is not a positive integer."""


class AllPinnedError(PolicyError):
    """An admission needs room but every resident key is pinned.

    Raised before any state changes, so the caller can wait for an in-flight
    copy to finish and simply retry the same request.
    """


class NotResidentError(PolicyError):
    """A key that is not resident was pinned."""


class NotPinnedError(PolicyError):
    """``unpin`` was called more often than ``pin`` for a key."""


class KeyPinnedError(PolicyError):
    """A pinned key was removed; its slot is still in use by a copy."""


def check_capacity(capacity: int) -> int:
    """Return ``capacity`` if it is a positive ``int``; raise otherwise."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise InvalidCapacityError(f"capacity must be a positive int, got {capacity!r}")
    return capacity


class PinCounts:
    """Nested pin counts per key, shared by the policies so the rules match.

    Only the count lives here; whether a key may be pinned (it must be
    resident) is checked by the policy, which knows residency.
    """

    def __init__(self) -> None:
        self._counts: dict[Hashable, int] = {}

    def pin(self, key: Hashable) -> None:
        """Add one pin to ``key``."""
        self._counts[key] = self._counts.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        """Drop one pin from ``key``; raise :class:`NotPinnedError` if it has none."""
        count = self._counts.get(key, 0)
        if count == 0:
            raise NotPinnedError(f"{key!r} is not pinned")
        if count == 1:
            del self._counts[key]
        else:
            self._counts[key] = count - 1

    def __contains__(self, key: Hashable) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        """Number of distinct pinned keys (not the sum of counts)."""
        return len(self._counts)

    def count(self, key: Hashable) -> int:
        """How many pins ``key`` holds (0 if none)."""
        return self._counts.get(key, 0)


class EvictionPolicy(ABC):
    """A fixed-capacity set of resident keys with a rule for choosing victims."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """The most keys that may be resident at once."""

    @abstractmethod
    def grow(self, capacity: int) -> None:
        """Raise the capacity to ``capacity`` (never lower it); nothing resident moves.

        The host tier's slots arrive while its memory is pinned in the
        background, and the policy must only fill the slots that exist.
        """

    @abstractmethod
    def request(self, key: Hashable) -> bool:
        """Record an access to ``key``; return True on a hit.

        On a miss the key is admitted, evicting (and reporting through
        ``on_evict``) at most one unpinned resident key if the cache is full.
        Raises :class:`AllPinnedError`, with no state change, if room is
        needed and every resident key is pinned.
        """

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """True if ``key`` is resident (ghost entries do not count)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def remove(self, key: Hashable) -> bool:
        """Drop a resident key without calling ``on_evict``; False if not resident.

        Raises :class:`KeyPinnedError` if the key is pinned.
        """

    @abstractmethod
    def pin(self, key: Hashable) -> None:
        """Protect a resident key from eviction; raise :class:`NotResidentError` otherwise."""

    @abstractmethod
    def unpin(self, key: Hashable) -> None:
        """Undo one ``pin``; raise :class:`NotPinnedError` if none is left."""

    @abstractmethod
    def is_pinned(self, key: Hashable) -> bool:
        """True if ``key`` holds at least one pin."""

    @abstractmethod
    def resident_keys(self) -> Iterator[Hashable]:
        """Iterate over a snapshot of the resident keys (safe to mutate meanwhile)."""

    def peek(self, key: Hashable) -> bool:
        """True if ``key`` is resident; unlike ``request`` it changes nothing."""
        return key in self


class PinnedPolicy(EvictionPolicy):
    """What ARC and LRU share: a capacity that only grows, pins counted per key, the evict callback.

    A subclass keeps its resident keys its own way and answers
    ``__contains__`` and :meth:`_drop` (forget a resident key) for them.
    """

    def __init__(self, capacity: int, on_evict: EvictCallback = None) -> None:
        self._c = check_capacity(capacity)
        self._pins = PinCounts()
        self._on_evict = on_evict

    @property
    def capacity(self) -> int:
        return self._c

    def grow(self, capacity: int) -> None:
        self._c = max(self._c, check_capacity(capacity))

    def pin(self, key: Hashable) -> None:
        if key not in self:
            raise NotResidentError(f"cannot pin {key!r}: not resident")
        self._pins.pin(key)

    def unpin(self, key: Hashable) -> None:
        self._pins.unpin(key)

    def is_pinned(self, key: Hashable) -> bool:
        return key in self._pins

    def remove(self, key: Hashable) -> bool:
        if key in self._pins:
            raise KeyPinnedError(f"cannot remove {key!r}: pinned")
        return self._drop(key)

    @abstractmethod
    def _drop(self, key: Hashable) -> bool:
        """Forget ``key`` if it is resident (no callback); False if it was not."""
