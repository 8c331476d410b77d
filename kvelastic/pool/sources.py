"""Where physical pages come from, as small composable adaptors (RMM style).

``DeviceSource`` creates and destroys pages through a backend. ``LimitedSource``
refuses to hand out more than a byte limit. ``ReserveSource`` keeps released
pages warm so the hot path maps without creating. The pool stacks them as
``ReserveSource(LimitedSource(DeviceSource(backend)))``: the limit then counts
every physical byte the process holds, mapped or waiting in the reserve.
Later layers (a budget shared by several processes) slot in the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Callable

from kvelastic.errors import PoolLimitExceeded
from kvelastic.pool.backend import PhysicalBackend
from kvelastic.units import format_size


class PageSource(ABC):
    """Hands out physical pages of one size, all or nothing."""

    def __init__(self, page_bytes: int):
        self.page_bytes = page_bytes

    @abstractmethod
    def acquire(self, count: int, *, force: bool = False) -> list[Any]:
        """Return ``count`` page handles or raise :class:`PoolExhausted` having taken none.

        ``force`` overrides policy (limits, budgets) but not physics: the device
        may still refuse. It exists for commitments made on a stale estimate.
        """

    @abstractmethod
    def release(self, handles: list[Any]) -> None:
        """Take pages back."""

    @property
    @abstractmethod
    def outstanding_bytes(self) -> int:
        """Bytes handed out by this source and not yet released to it."""


class DeviceSource(PageSource):
    """Creates pages on the backend's device; counts what exists, to prove no leak."""

    def __init__(self, backend: PhysicalBackend, page_bytes: int):
        super().__init__(page_bytes)
        self.backend = backend
        self._live = 0
        self.created_total = 0

    def acquire(self, count: int, *, force: bool = False) -> list[Any]:
        handles: list[Any] = []
        try:
            for _ in range(count):
                handles.append(self.backend.create_page(self.page_bytes))
        except BaseException:
            for handle in handles:
                self.backend.release_page(handle)
            raise
        self._live += count
        self.created_total += count
        return handles

    def release(self, handles: list[Any]) -> None:
        for handle in handles:
            self.backend.release_page(handle)
        self._live -= len(handles)

    @property
    def outstanding_bytes(self) -> int:
        return self._live * self.page_bytes


class LimitedSource(PageSource):
    """Caps the bytes outstanding from ``upstream``; the cap can change at run time."""

    def __init__(self, upstream: PageSource, limit_bytes: int | None):
        super().__init__(upstream.page_bytes)
        self.upstream = upstream
        self.limit_bytes = limit_bytes
        self._outstanding = 0

    def headroom_bytes(self) -> int | None:
        """Bytes that may still be acquired, or None when unlimited."""
        if self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - self._outstanding)

    def acquire(self, count: int, *, force: bool = False) -> list[Any]:
        wanted = count * self.page_bytes
        headroom = self.headroom_bytes()
        if headroom is not None and wanted > headroom and not force:
            raise PoolLimitExceeded(
                f"mapping {format_size(wanted)} more would exceed the limit of "
                f"{format_size(self.limit_bytes or 0)} ({format_size(self._outstanding)} held)",
                requested_bytes=wanted, available_bytes=headroom)
        handles = self.upstream.acquire(count, force=force)
        self._outstanding += wanted
        return handles

    def release(self, handles: list[Any]) -> None:
        self.upstream.release(handles)
        self._outstanding -= len(handles) * self.page_bytes

    @property
    def outstanding_bytes(self) -> int:
        return self._outstanding


class ReserveSource(PageSource):
    """Keeps released pages for reuse so mapping rarely has to create one."""

    def __init__(self, upstream: PageSource, on_drop: Callable[[list[Any]], None] | None = None):
        """``on_drop(handles)`` hears of pages given back upstream (their handles may be reused)."""
        super().__init__(upstream.page_bytes)
        self.upstream = upstream
        self.on_drop = on_drop
        self._cached: deque[Any] = deque()
        self._outstanding = 0
        self.hits = 0
        self.misses = 0

    @property
    def cached_pages(self) -> int:
        return len(self._cached)

    def acquire(self, count: int, *, force: bool = False) -> list[Any]:
        from_cache = min(count, len(self._cached))
        fresh = self.upstream.acquire(count - from_cache, force=force) if count > from_cache else []
        handles = [self._cached.popleft() for _ in range(from_cache)] + fresh
        self.hits += from_cache
        self.misses += len(fresh)
        self._outstanding += count * self.page_bytes
        return handles

    def release(self, handles: list[Any]) -> None:
        self._cached.extend(handles)
        self._outstanding -= len(handles) * self.page_bytes

    def grow(self, pages: int) -> int:
        """Create up to ``pages`` more pages ahead of demand; stop quietly at any limit."""
        from kvelastic.errors import PoolExhausted

        added = 0
        while added < pages:
            try:
                self._cached.extend(self.upstream.acquire(1))
            except PoolExhausted:
                break
            added += 1
        return added

    def trim(self, keep_pages: int) -> int:
        """Give cached pages beyond ``keep_pages`` back upstream; return how many went."""
        surplus = max(0, len(self._cached) - keep_pages)
        if surplus:
            dropped = [self._cached.pop() for _ in range(surplus)]
            self.upstream.release(dropped)
            if self.on_drop is not None:
                self.on_drop(dropped)
        return surplus

    @property
    def outstanding_bytes(self) -> int:
        return self._outstanding
