"""One engine's membership in its GPU's shared KV account.

Joined when the scheduler attaches (after start-up warm-up, which must never be
refused); from then on every physical page the engine creates is granted by
the account. Each reclaimer tick reports what the engine holds, picks up
limits changed at run time (``kvelastic limit NAME 8GiB``) and gives memory
back when other engines on the GPU are waiting for it.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from typing import Any

from kvelastic.cluster.account import SharedAccount
from kvelastic.cluster.errors import ClusterError
from kvelastic.cluster.source import SharedBudgetSource
from kvelastic.integration.elastic_cache import ElasticKVCache
from kvelastic.settings import Settings
from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")


def gpu_identity(cache: ElasticKVCache) -> tuple[str, int | None]:
    """A name for the device's account file, and its total memory when known."""
    backend = cache.pool.backend
    if backend.name != "cuda":
        return f"{backend.name}-{socket.gethostname()}", None
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = str(getattr(props, "uuid", "")) or f"index{torch.cuda.current_device()}"
    return f"gpu-{uuid}", int(props.total_memory)


def default_name(settings: Settings, model: str) -> str:
    base = os.path.basename(model.rstrip("/")) or "vllm"
    suffix = settings.port or os.getpid()
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in f"{base}-{suffix}")[:64]


class ClusterLink:
    """Joins the account, gates the pool with it, and keeps the two in step."""

    def __init__(self, cache: ElasticKVCache, source: SharedBudgetSource, settings: Settings,
                 model: str, limit_bytes: int | None):
        gpu_id, total = gpu_identity(cache)
        budget = settings.shared_budget_bytes or total or 1 << 62
        self.account = SharedAccount.open(gpu_id, budget, reset_budget=bool(settings.shared_budget_bytes))
        self.name = settings.name or default_name(settings, model)
        self.member = self.account.join(self.name, model=model, port=settings.port,
                                        min_bytes=settings.min_bytes, max_bytes=limit_bytes or 0)
        source.attach(self.member)
        cache.external_headroom = self.headroom
        self.source = source
        self.cache = cache
        self.base_limit = limit_bytes or None  # the start-up cap: vLLM's profiled KV bytes or KVELASTIC_LIMIT
        self._restore_tried = False  # wrote the start-up cap back over the account's current 0
        atexit.register(self.leave)
        log.info("kvelastic: joined the shared KV account of %s as %r", gpu_id, self.name)

    def headroom(self) -> int:
        """Bytes the account would still grant this engine (asked at most every 50 ms)."""
        return self.member.request(0).available_bytes

    def tick(self, queue: Any, offload: Any) -> int:
        """Report, apply the current limit; return the bytes other engines want back from us."""
        pool = self.cache.pool
        stats = pool.stats()
        cached = queue.cached_groups() * self.cache.group_bytes + stats.reserve_bytes
        host = offload.stats()["host_bytes_used"] if offload is not None else None
        t = self.member.tick(cached_bytes=cached, host_bytes=host)
        limit = self.limit_for(t.max_bytes)
        if limit != stats.limit_bytes:
            pool.set_limit(limit)
            log.info("kvelastic: %s limit now %s", self.name, format_size(limit) if limit else "none")
        if t.max_bytes:
            self._restore_tried = False
        elif self.base_limit and not self._restore_tried:
            self._restore_tried = True  # once per change to 0: a refusal must not repeat every tick
            self._show_restored_cap()
        return t.pressure_bytes

    def limit_for(self, max_bytes: int) -> int | None:
        """The pool limit for the account's ``max_bytes``: 0 means the start-up cap, never none.

        vLLM sized this engine (weights, activations, CUDA graphs) around its
        profiled KV bytes; an engine that started capped must not silently grow
        over the whole GPU because someone cleared its cap in the account.
        """
        return max_bytes or self.base_limit

    def _show_restored_cap(self) -> None:
        """Write the start-up cap back where the account says 0, so ``kvelastic status`` shows what holds.

        Only a writer other than ``kvelastic limit`` (which restores the cap
        itself) leaves 0 there. Never raises: the pool holds the cap either way.
        """
        try:
            self.account.restore_max(self.name, only_if_cleared=True)
        except ClusterError as error:  # e.g. a min raised above the start-up cap meanwhile
            log.warning("kvelastic: %s keeps its start-up cap %s but could not show it in the account: %s",
                        self.name, format_size(self.base_limit or 0), error)

    def leave(self) -> None:
        self.cache.external_headroom = None
        self.source.member = None  # pages freed after leaving are no longer the account's business
        try:
            self.member.leave()
            self.account.close()
        except Exception:  # noqa: BLE001 - leaving at exit must not raise; a dead member is reclaimed anyway
            pass
