"""Driver calls off the scheduler's thread: a worker that maps and unmaps page groups.

Mapping a group costs tens of microseconds per page in the driver (mostly
``cuMemSetAccess``), and the scheduler runs on vLLM's critical path. The
page-aware queue therefore asks this worker to map groups *ahead* of need and
to unmap groups it no longer wants, and only maps synchronously (through the
same worker, so commands stay in order) when a burst outruns the prefetch.

Commands run strictly in the order they were queued, so "unmap g" followed by
"map g" can never be reordered. Results come back through thread-safe deques
that the queue drains on its own thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Iterable

from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.pool.backend import Fence
from kvelastic.roles import Mapper

log = logging.getLogger("vllm.kvelastic")

MAP, UNMAP, FORCE_MAP, BARRIER = "map", "unmap", "force-map", "barrier"


class GroupMapper(Mapper):
    """Executes map/unmap commands for one elastic cache in this process, inline or on a daemon thread."""

    synchronous = True  # map_now returns with the groups mapped (or refused)
    requests_hold_room = False  # the pool takes pages when the worker maps a group, not when it is asked

    def __init__(self, cache: ElasticKVCache):
        self.cache = cache
        self.mapped: deque[int] = deque()
        self.refused: deque[int] = deque()
        self._commands: deque[tuple[str, int, threading.Event | None, Any]] = deque()
        self._wake = threading.Event()
        self._draining = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvelastic-mapper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def request_map(self, groups: Iterable[int]) -> None:
        self._submit(MAP, groups, None)

    def request_unmap(self, groups: Iterable[int], after: Fence | None = None) -> None:
        """Unmap ``groups`` once the GPU is done with them, and once fence ``after`` passes."""
        self._submit(UNMAP, groups, None, after)

    def map_now(self, groups: list[int], *, force: bool = False) -> None:
        """Map ``groups`` after everything queued before them, and wait until all of it is done.

        With no groups this still waits for the commands already queued (maps
        requested ahead of need that a burst now depends on). ``force``: past
        the limit and the shared budget (never past the device).
        """
        done = threading.Event()
        if groups:
            self._submit(FORCE_MAP if force else MAP, groups, done)
        else:
            self._submit(BARRIER, [-1], done)
        if self._thread is not None:
            done.wait()

    def _submit(self, kind: str, groups: Iterable[int], done: threading.Event | None,
                after: Any = None) -> None:
        groups = list(groups)
        for i, group in enumerate(groups):
            self._commands.append((kind, group, done if i == len(groups) - 1 else None, after))
        if done is not None and not groups:
            done.set()
        if self._thread is None:
            self._drain()
        else:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(0.05)
            self._wake.clear()
            try:
                self._drain()
                self.cache.pool.collect()
            except Exception:  # noqa: BLE001 - the worker must survive to serve the next command
                log.exception("kvelastic: group mapper failed; continuing")

    def busy(self) -> bool:
        return self._draining or bool(self._commands)

    def _drain(self) -> None:
        self._draining = True
        try:
            self._drain_queued()
        finally:
            self._draining = False

    def _drain_queued(self) -> None:
        while self._commands:
            kind = self._commands[0][0]
            batch: list[tuple[str, int, threading.Event | None, Any]] = []
            while self._commands and self._commands[0][0] == kind:
                batch.append(self._commands.popleft())
            groups = [g for _, g, _, _ in batch]
            try:
                if kind in (MAP, FORCE_MAP):
                    self._map(groups, force=kind == FORCE_MAP)
                elif kind == UNMAP:
                    after = [a for a in {id(a): a for _, _, _, a in batch if a is not None}.values()]
                    self.cache.unmap_groups(groups, after=after)
            finally:
                for _, _, done, _ in batch:
                    if done is not None:
                        done.set()

    def _map(self, groups: list[int], force: bool = False) -> None:
        done = self.cache.map_as_many(groups, force=force)
        self.mapped.extend(groups[:done])
        self.refused.extend(groups[done:])
