"""Per-process state of kvelastic inside a vLLM process.

vLLM calls the patched functions without any handle of ours, so the patches
are bound, when applied, to the one ``Runtime`` of their process. It carries
the settings, the capacity plan decided by the worker, the pool and elastic KV
cache created at allocation, and what the scheduler needs to find them.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kvelastic.settings import Settings
from kvelastic.tp.handovers import RankHandovers
from kvelastic.units import format_size

if TYPE_CHECKING:
    from kvelastic.cluster.source import SharedBudgetSource
    from kvelastic.scheduler.elastic_cache import ElasticKVCache
    from kvelastic.pool import PagePool, PhysicalBackend
    from kvelastic.tp.rank import RankWorker

log = logging.getLogger("vllm.kvelastic")


@dataclass(frozen=True)
class CapacityPlan:
    """How large the KV cache looks to vLLM (virtual) and how much of it may be real."""

    virtual_bytes: int
    limit_bytes: int
    profiled_bytes: int


@dataclass(frozen=True)
class EnginePool:
    """A pool of this process and the shared-budget layer of its page source stack.

    The layer only counts until the scheduler joins the GPU's shared account
    through it; from then on the account grants every page the pool creates.
    """

    pool: "PagePool"
    budget: "SharedBudgetSource"


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
        #: The shared-budget layer under the published cache's pool (None if another made that pool).
        self.budget: "SharedBudgetSource | None" = None
        self._pools: list[EnginePool] = []
        self.rank_worker: "RankWorker | None" = None  # set on a worker rank whose scheduler is another process
        #: What the executor learnt from its worker ranks, for the scheduler (the engine core's process only).
        self.rank_handovers = RankHandovers()
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

    @property
    def limit_bytes(self) -> int | None:
        """The physical KV limit: the capacity plan's once there is one, else the user's setting."""
        return self.plan.limit_bytes if self.plan else self.settings.limit_bytes

    # ------------------------------------------------------------ allocation
    def new_pool(self) -> "PagePool":
        """A pool for the allocation in progress; earlier pools retire once their tensors die.

        Its stack, top down: warm reserve, limit, the GPU's shared budget,
        page statistics, the device. No limit and no account yet: start-up
        warm-up maps what it needs; the scheduler then sets the limit and joins
        the account through :attr:`budget`.
        """
        from kvelastic.cluster.source import SharedBudgetSource
        from kvelastic.pool import DeviceSource, LimitedSource, PagePool, ReserveSource, StatisticsSource

        backend = self.backend_factory()
        self._set_switch_interval()
        budget = SharedBudgetSource(StatisticsSource(DeviceSource(backend, self.settings.chunk_bytes)))
        pool = PagePool(backend, ReserveSource(LimitedSource(budget)), zero_on_map="fresh")
        with self._lock:
            self._pools.append(EnginePool(pool, budget))
        self._allocating.pool = pool
        return pool

    def _set_switch_interval(self) -> None:
        """``KVELASTIC_SWITCH_INTERVAL`` in this process, whose pool's threads (the mapper, the
        upkeep) win the GIL back from vLLM's busy loop after each driver call (docs/pool.md)."""
        wanted = self.settings.switch_interval_s
        if wanted is None or math.isclose(sys.getswitchinterval(), wanted, abs_tol=1e-6):
            return  # CPython keeps whole microseconds: 0.0002 reads back as 0.00019999999999999998
        sys.setswitchinterval(wanted)
        log.info("kvelastic: Python's thread switch interval is %g ms in this process (KVELASTIC_SWITCH_INTERVAL)",
                 sys.getswitchinterval() * 1e3)

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
            self.budget = next((p.budget for p in self._pools if p.pool is cache.pool), None)
        self.retire_unused_pools()

    def retire_unused_pools(self) -> None:
        """Close pools other than the live cache's once every tensor of theirs is gone."""
        with self._lock:
            live = self.cache.pool if self.cache else None
            keep = []
            for engine_pool in self._pools:
                if engine_pool.pool is live or engine_pool.pool.regions_alive():
                    keep.append(engine_pool)
                else:
                    engine_pool.pool.close()
            self._pools = keep
