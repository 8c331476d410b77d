"""The scheduler and its engine's KV cache in one process (one GPU, the uniprocess executor).

:class:`LocalConnection` is the :class:`~kvelastic.hooks.connection.CacheConnection` for
this case: the cache itself, a mapper thread that makes the driver calls off
the scheduler's thread, a host tier pinned here with a copier on this GPU, and
the GPU's shared account, which the engine joins where its pool has a
shared-budget gate. Its counterpart under tensor parallelism is
:class:`~kvelastic.tp.scheduler_side.RankConnection`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.scheduler.mapper import GroupMapper
from kvelastic.hooks.connection import CacheConnection, member_terms

if TYPE_CHECKING:
    from kvelastic.roles import AccountLink
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.startup.runtime import Runtime
    from kvelastic.offload.copier import BlockCopier
    from kvelastic.offload.host_tier import HostTier
    from kvelastic.offload.plan import HostPlan
    from kvelastic.settings import Settings


class LocalConnection(CacheConnection):
    """A KV cache in the scheduler's own process; from here on its pool holds ``limit_bytes``."""

    rank_held_bytes = None  # one pool, in this process: its own statistics say what it holds
    async_loads = True  # the copier's fences are this process's CUDA events
    unmaps_between_steps = True  # the pool is in this process

    def __init__(self, cache: ElasticKVCache, limit_bytes: int | None):
        cache.pool.set_limit(limit_bytes)  # start-up warm-up ran unlimited; from here the limit holds
        self.cache = cache
        self.mapper = GroupMapper(cache)
        self.limit_bytes = limit_bytes

    @classmethod
    def of(cls, runtime: "Runtime", cache: ElasticKVCache) -> "LocalConnection":
        """The runtime's cache under the runtime's limit."""
        return cls(cache, runtime.limit_bytes)

    def host_tier(self, settings: "Settings", plan: "HostPlan") -> tuple["HostTier", "BlockCopier"]:
        from kvelastic.hooks.offload_setup import local_host_tier

        return local_host_tier(self.cache, settings.cpu_bytes or 0, settings.cpu_policy, plan)

    def step_hook(self, scheduler: Any, queue: "PageAwareFreeQueue") -> Callable[[Any], None] | None:
        """None: the pool is in this process; a step's output carries nothing for it."""
        return None

    def reply_hook(self) -> Callable[[Any], None] | None:
        """None: nothing of the pool rides a step's output."""
        return None

    def idle_work(self) -> None:
        """None: the pool is in this process, and it unmaps between steps by itself."""
        return None

    def join_account(self, scheduler: Any, runtime: "Runtime") -> "AccountLink | None":
        """Join the GPU's shared account; None where the pool has no shared-budget gate."""
        source = runtime.budget
        if source is None:
            return None
        from kvelastic.scheduler.cluster_link import join_shared_account

        return join_shared_account(self.cache, source, member_terms(runtime.settings, scheduler), self.limit_bytes)
