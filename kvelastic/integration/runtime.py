"""Per-process state of kvelastic inside a vLLM process.

vLLM calls the patched functions without any handle of ours, so the patches
are bound, when applied, to the one ``Runtime`` of their process. It carries
the settings, the capacity plan decided by the worker, the pool and elastic KV
cache created at allocation, and what the scheduler needs to find them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from kvelastic.settings import Settings
from kvelastic.units import format_size

if TYPE_CHECKING:
    from kvelastic.integration.elastic_cache import ElasticKVCache
    from kvelastic.pool import PagePool, PhysicalBackend
    from kvelastic.pool.sources import PageSource

log = logging.getLogger("vllm.kvelastic")


@dataclass(frozen=True)
class CapacityPlan:
    """How large the KV cache looks to vLLM (virtual) and how much of it may be real."""

    virtual_bytes: int
    limit_bytes: int
    profiled_bytes: int


def default_backend() -> "PhysicalBackend":
    from kvelastic.pool.cuda import CudaBackend

    return CudaBackend()


class Runtime:
    """Everything kvelastic keeps for one vLLM process."""

    def __init__(self, settings: Settings, backend_factory: Callable[[], "PhysicalBackend"] = default_backend):
        self.settings = settings
        self.backend_factory = backend_factory
        self.plan: CapacityPlan | None = None
        self.cache: "ElasticKVCache | None" = None
        self._pools: list["PagePool"] = []
        self.budget_sources: dict[int, Any] = {}
        self.rank_worker: Any = None  # set on a worker rank whose scheduler is another process
        self._allocating = threading.local()
        self._lock = threading.Lock()

    # ------------------------------------------------------------- capacity
    def plan_capacity(self, profiled_bytes: int, device_total_bytes: int) -> CapacityPlan:
        """Decide the virtual size shown to vLLM and the physical limit, from vLLM's own profile."""
        chunk = self.settings.chunk_bytes
        limit = self.settings.limit_bytes or profiled_bytes
        virtual = self.settings.virtual_bytes or max(profiled_bytes, device_total_bytes)
        virtual = max(virtual, limit) // chunk * chunk
        self.plan = CapacityPlan(virtual_bytes=virtual, limit_bytes=limit, profiled_bytes=profiled_bytes)
        log.info("kvelastic: KV cache virtual %s, physical limit %s (vLLM profiled %s)",
                 format_size(virtual), format_size(limit), format_size(profiled_bytes))
        return self.plan

    # ------------------------------------------------------------ allocation
    def new_pool(self) -> "PagePool":
        """A pool for the allocation in progress; earlier pools retire once their tensors die."""
        from kvelastic.pool import PagePool

        from kvelastic.cluster.source import SharedBudgetSource

        # No limit and no shared-budget gate yet: start-up warm-up maps what it needs;
        # the scheduler applies the limit and joins the GPU's shared account.
        holder: list[SharedBudgetSource] = []

        def gate(device: "PageSource") -> "PageSource":
            holder.append(SharedBudgetSource(device))
            return holder[0]

        pool = PagePool(self.backend_factory(), page_bytes=self.settings.chunk_bytes, zero_on_map="fresh",
                        wrap_device=gate)
        self.budget_sources[id(pool)] = holder[0]
        with self._lock:
            self._pools.append(pool)
        self._allocating.pool = pool
        return pool

    def allocation_pool(self) -> "PagePool | None":
        """The pool the current thread's allocation went to, if any."""
        return getattr(self._allocating, "pool", None)

    def finish_allocation(self) -> "PagePool | None":
        pool = self.allocation_pool()
        self._allocating.pool = None
        return pool

    def publish(self, cache: "ElasticKVCache") -> None:
        with self._lock:
            self.cache = cache
        self.retire_unused_pools()

    def retire_unused_pools(self) -> None:
        """Close pools other than the live cache's once every tensor of theirs is gone."""
        with self._lock:
            live = self.cache.pool if self.cache else None
            keep = []
            for pool in self._pools:
                if pool is live or pool.regions_alive():
                    keep.append(pool)
                else:
                    pool.close()
                    self.budget_sources.pop(id(pool), None)
            self._pools = keep
