"""Where physical pages come from: a stack of small sources, each over the one beneath (RMM style).

The root of a stack, :class:`DeviceSource`, creates and destroys pages through a
backend. Every other layer is a :class:`PageAdaptor` built over its *upstream*,
the one source beneath it, and knows nothing further down. The caller builds
the stack and hands its top, a :class:`ReserveSource`, to the pool::

    device = DeviceSource(backend, page_bytes)
    reserve = ReserveSource(LimitedSource(StatisticsSource(device), limit_bytes))
    pool = PagePool(backend, reserve)

``LimitedSource`` refuses to hand out more than a byte limit; ``ReserveSource``
keeps released pages warm so the hot path maps without creating; the
statistics adaptor (:mod:`kvelastic.pool.stats`) counts what passes through it.
Put under the reserve, the limit counts every physical byte the process holds,
mapped or warm. Another layer (a budget shared by several processes,
:class:`~kvelastic.cluster.source.SharedBudgetSource`) slots in the same way.

Besides pages, the pool asks the top of its stack a few questions: how many
more bytes it could have, how far it is over a cap, the stack's share of the
pool's statistics, a new limit, and which pages were destroyed. Each layer
answers its own part and passes the question to its upstream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

from kvelastic.errors import PoolError, PoolExhausted, PoolLimitExceeded
from kvelastic.pool.backend import PhysicalBackend
from kvelastic.units import format_size

#: Told the handles of pages just destroyed (a backend may reuse a handle for a new page).
DestroyedListener = Callable[[list[Any]], None]


#: What the warm reserve creates or gives back per call upstream while it grows or trims in turns:
#: one account transaction per batch, and a few driver calls (4 pages of 8 MiB) between two looks
#: at a thread waiting for the pool's lock.
BATCH_BYTES = 32 * 1024 * 1024


def _never() -> bool:
    return False


@dataclass(frozen=True)
class SourceReport:
    """What the layers of a stack know about its pages, each layer filling in its own fields."""

    device_bytes: int = 0  # the root: bytes of pages that exist
    pages_created: int = 0  # a statistics adaptor: pages acquired through it
    limit_bytes: int | None = None  # a limit: its current cap
    reserve_pages: int = 0  # the reserve: warm pages, and how acquisitions were served
    reserve_hits: int = 0
    reserve_misses: int = 0


class PageSource(ABC):
    """Hands out physical pages of one size, all or nothing.

    The question methods answer as a source with nothing beneath it;
    :class:`PageAdaptor` passes them on to its upstream instead.
    """

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

    def headroom_bytes(self, device_free: int | None) -> int | None:
        """Bytes this stack could still hand out, given the device's free bytes as last read.

        ``device_free`` None means unknown; the answer None means nothing bounds it.
        """
        return device_free

    def excess_bytes(self) -> int:
        """Bytes held above a cap somewhere in this stack (0 when within every cap)."""
        return 0

    def set_limit(self, limit_bytes: int | None) -> None:
        """Give the stack's limit a new value."""
        raise PoolError(f"this page source stack has no limit to set (its root is {type(self).__name__})")

    def report(self) -> SourceReport:
        """This layer's and every layer beneath's share of the pool's statistics."""
        return SourceReport()

    def watch_destroyed(self, listener: DestroyedListener) -> None:
        """Call ``listener(handles)`` whenever pages of this stack are destroyed."""
        raise PoolError(f"{type(self).__name__} does not report destroyed pages")


class PageAdaptor(PageSource):
    """A layer over one upstream source; it passes every question it does not answer to it."""

    def __init__(self, upstream: PageSource):
        super().__init__(upstream.page_bytes)
        self.upstream = upstream

    def headroom_bytes(self, device_free: int | None) -> int | None:
        return self.upstream.headroom_bytes(device_free)

    def excess_bytes(self) -> int:
        return self.upstream.excess_bytes()

    def set_limit(self, limit_bytes: int | None) -> None:
        self.upstream.set_limit(limit_bytes)

    def report(self) -> SourceReport:
        return self.upstream.report()

    def watch_destroyed(self, listener: DestroyedListener) -> None:
        self.upstream.watch_destroyed(listener)


class DeviceSource(PageSource):
    """Creates pages on the backend's device: the root of every stack."""

    def __init__(self, backend: PhysicalBackend, page_bytes: int):
        if page_bytes <= 0 or page_bytes % backend.granularity:
            raise PoolError(f"page size {page_bytes} is not a positive multiple of the "
                            f"{backend.name} granularity {backend.granularity}")
        super().__init__(page_bytes)
        self.backend = backend
        self._live = 0
        self._listeners: list[DestroyedListener] = []

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
        return handles

    def release(self, handles: list[Any]) -> None:
        for handle in handles:
            self.backend.release_page(handle)
        self._live -= len(handles)
        for listener in self._listeners:
            listener(handles)

    @property
    def outstanding_bytes(self) -> int:
        return self._live * self.page_bytes

    def report(self) -> SourceReport:
        return SourceReport(device_bytes=self.outstanding_bytes)

    def watch_destroyed(self, listener: DestroyedListener) -> None:
        self._listeners.append(listener)


class LimitedSource(PageAdaptor):
    """Caps the bytes outstanding from ``upstream``; the cap can change at run time."""

    def __init__(self, upstream: PageSource, limit_bytes: int | None = None):
        super().__init__(upstream)
        self.limit_bytes = limit_bytes
        self._outstanding = 0

    def _own_headroom(self) -> int | None:
        if self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - self._outstanding)

    def acquire(self, count: int, *, force: bool = False) -> list[Any]:
        wanted = count * self.page_bytes
        headroom = self._own_headroom()
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

    def headroom_bytes(self, device_free: int | None) -> int | None:
        rooms = [r for r in (self._own_headroom(), self.upstream.headroom_bytes(device_free)) if r is not None]
        return min(rooms) if rooms else None

    def excess_bytes(self) -> int:
        own = 0 if self.limit_bytes is None else max(0, self._outstanding - self.limit_bytes)
        return max(own, self.upstream.excess_bytes())

    def set_limit(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes

    def report(self) -> SourceReport:
        return replace(self.upstream.report(), limit_bytes=self.limit_bytes)


class ReserveSource(PageAdaptor):
    """Keeps released pages for reuse so mapping rarely has to create one.

    Warm pages never keep the stack above a cap: whenever its upstream is over
    one (a release, a lowered limit), the reserve gives pages back until it is
    not, or until it has none left.

    It grows and trims ``batch_bytes`` of pages per call upstream, not a page
    per call: a layer may cost as much for one page as for many (a shared
    account's file transaction is the same for 2 MiB as for 32).
    """

    def __init__(self, upstream: PageSource, *, batch_bytes: int = BATCH_BYTES):
        super().__init__(upstream)
        self._cached: deque[Any] = deque()
        self._outstanding = 0
        self.batch_pages = max(1, batch_bytes // self.page_bytes)
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
        self._trim_excess()

    @property
    def outstanding_bytes(self) -> int:
        return self._outstanding

    def grow(self, pages: int, *, stop: Callable[[], bool] = _never) -> int:
        """Create up to ``pages`` more pages ahead of demand, :attr:`batch_pages` per request upstream.

        Stops quietly at any limit: a refused batch is halved down to one page
        first, so growth still ends at the limit's last page. ``stop()`` may end
        it after any batch (the pool's lock is wanted elsewhere: the caller resumes).
        """
        added, batch = 0, self.batch_pages
        while added < pages:
            count = min(batch, pages - added)
            try:
                self._cached.extend(self.upstream.acquire(count))
            except PoolExhausted:
                if count == 1:
                    break
                batch = count // 2
                continue
            added += count
            if stop():
                break
        return added

    def trim(self, keep_pages: int, *, stop: Callable[[], bool] = _never) -> int:
        """Give cached pages beyond ``keep_pages`` back upstream; return how many went. With ``stop``
        they go :attr:`batch_pages` at a time, until ``stop()`` says so after a batch."""
        surplus = max(0, len(self._cached) - keep_pages)
        batch = surplus if stop is _never else self.batch_pages
        gone = 0
        while gone < surplus:
            count = min(batch, surplus - gone)
            self.upstream.release([self._cached.pop() for _ in range(count)])
            gone += count
            if stop():
                break
        return gone

    def _trim_excess(self) -> None:
        excess = self.upstream.excess_bytes()
        if excess:
            self.trim(max(0, len(self._cached) - -(-excess // self.page_bytes)))

    def headroom_bytes(self, device_free: int | None) -> int | None:
        room = self.upstream.headroom_bytes(device_free)
        return None if room is None else len(self._cached) * self.page_bytes + room

    def set_limit(self, limit_bytes: int | None) -> None:
        self.upstream.set_limit(limit_bytes)
        self._trim_excess()

    def report(self) -> SourceReport:
        return replace(self.upstream.report(), reserve_pages=len(self._cached),
                       reserve_hits=self.hits, reserve_misses=self.misses)
