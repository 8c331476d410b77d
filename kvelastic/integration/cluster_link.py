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
from kvelastic.cluster.source import SharedBudgetSource
from kvelastic.integration.elastic_cache import ElasticKVCache
from kvelastic.settings import Settings

log = logging.getLogger("kvelastic")


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
        self.base_limit = limit_bytes
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
        limit = t.max_bytes or None
        if limit != stats.limit_bytes:
            pool.set_limit(limit)
            log.info("kvelastic: %s limit now %s", self.name, limit if limit else "none")
        return t.pressure_bytes

    def leave(self) -> None:
        self.cache.external_headroom = None
        self.source.member = None  # pages freed after leaving are no longer the account's business
        try:
            self.member.leave()
            self.account.close()
        except Exception:  # noqa: BLE001 - leaving at exit must not raise; a dead member is reclaimed anyway
            pass
