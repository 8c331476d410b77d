"""How a scheduler reaches its engine's KV cache: the connection the scheduler's hooks are built on.

The core's roles (:mod:`kvelastic.roles`) are what the queue, the host tier and
upkeep work against; a connection is what builds them for one engine, from the
engine's settings and start-up state, in one of two ways:
:class:`~kvelastic.hooks.local_connection.LocalConnection` (the cache in this
process) or :class:`~kvelastic.tp.scheduler_side.RankConnection` (the cache on
worker ranks). It sits above the core because it reads both.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kvelastic.roles import AccountLink, Copier, Mapper, SchedulerCache

if TYPE_CHECKING:
    from kvelastic.offload.host_tier import HostTier
    from kvelastic.offload.plan import HostPlan
    from kvelastic.scheduler.cluster_link import MemberTerms
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.settings import Settings
    from kvelastic.startup.runtime import Runtime
    from kvelastic.tp.idle_steps import IdleSteps

__all__ = ["CacheConnection"]


class CacheConnection(Protocol):
    """How a scheduler reaches its engine's KV cache: the cache and mapper, and what differs around them."""

    cache: SchedulerCache
    mapper: Mapper
    #: What each GPU's pool really holds, for the log line; None with a single pool in this process.
    rank_held_bytes: Callable[[], list[int]] | None
    #: Whether a host load can run beside compute: its copier's fence says when it is done without this
    #: process waiting on another (the host tier's plan loads hits beside compute only then).
    async_loads: bool
    #: Whether an unmap takes effect between two steps (the pool is in this process); False where the
    #: ranks apply it with their next step.
    unmaps_between_steps: bool

    @abstractmethod
    def host_tier(self, settings: "Settings", plan: "HostPlan") -> tuple["HostTier", Copier]:
        """The host tier's index of ``settings.cpu_bytes`` and the copier that fills its slots, as ``plan``
        has them."""

    @abstractmethod
    def step_hook(self, scheduler: Any, queue: "PageAwareFreeQueue") -> Callable[[Any], None] | None:
        """What must happen to each ``schedule()`` output before it leaves the scheduler; None: nothing."""

    @abstractmethod
    def reply_hook(self) -> Callable[[Any], None] | None:
        """What each ``update_from_output``'s model output gives up before vLLM reads it; None: nothing."""

    @abstractmethod
    def idle_work(self) -> "IdleSteps | None":
        """Commands for idle ranks that ride an empty step: while they wait the scheduler's ``has_requests()``
        is true, and the engine's loop registers its wake-up with them; None: nothing."""

    @abstractmethod
    def join_account(self, scheduler: Any, runtime: "Runtime") -> AccountLink | None:
        """This engine's membership in its GPUs' shared accounts; None where it joins none."""


def member_terms(settings: "Settings", scheduler: Any) -> "MemberTerms":
    """The terms an engine joins its GPUs' accounts on: its settings, and the model vLLM serves."""
    from kvelastic.scheduler.cluster_link import MemberTerms

    return MemberTerms(name=settings.name, model=str(scheduler.vllm_config.model_config.model or ""),
                       port=settings.port, min_bytes=settings.min_bytes,
                       shared_budget_bytes=settings.shared_budget_bytes)
