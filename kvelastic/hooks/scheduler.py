"""Attach a vLLM scheduler to the elastic KV cache of its engine.

Called right after ``Scheduler.__init__``: the GPU block pool becomes
page-aware, the scheduler's entry points that touch the block pool take one
lock (shared with the reclaimer thread), and the reclaimer starts. The cache
is in this process (one GPU, uniprocess executor) or sharded over worker ranks
in child processes (tensor parallelism, multiprocess executor: see
:mod:`kvelastic.tp`); :func:`_connect` decides which, once, and everything
after it works on the :class:`~kvelastic.hooks.connection.CacheConnection` it returns.

Every change to the scheduler's objects goes through the activation's
:class:`~kvelastic.patching.apply.Patcher`, on contacts the gate checked
(``patches/scheduler_block_pool.py`` lists them). Attaching is all or nothing:
if it fails, each change made to this scheduler is undone and the threads
started for it are stopped before the error propagates.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from kvelastic.hooks import commit_guard
from kvelastic.hooks.block_pool import make_page_aware
from kvelastic.hooks.connector_fence import check_offload_owner, may_walk_free_queue, transfers_in_flight
from kvelastic.hooks.local_connection import LocalConnection
from kvelastic.startup.runtime import Runtime
from kvelastic.scheduler.upkeep import UpkeepThread, engine_upkeep
from kvelastic.patches.scheduler_block_pool import LOCKED, RESET_PREFIX_CACHE, SCHEDULE, UPDATE_FROM_OUTPUT
from kvelastic.patches._common import argument
from kvelastic.offload.plan import HostPlan, host_plan
from kvelastic.patching.apply import Patcher
from kvelastic.hooks.connection import CacheConnection
from kvelastic.settings import Settings

if TYPE_CHECKING:
    from kvelastic.hooks.commit_guard import CommitGuard
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.offload.manager import OffloadManager
    from kvelastic.roles import AccountLink
    from kvelastic.scheduler.reload_reserve import ReloadReserve
    from kvelastic.tp.idle_steps import IdleSteps

log = logging.getLogger("vllm.kvelastic")

#: Names of the scheduler methods that take the lock (declared in patches/scheduler_block_pool.py).
LOCKED_METHODS = tuple(target.name for target in LOCKED)


def attach_scheduler(scheduler: Any, runtime: Runtime, patcher: Patcher) -> UpkeepThread:
    """Make ``scheduler``'s GPU block pool page-aware and start its reclaimer; undone whole on failure."""
    started: list[Any] = []  # threads to stop if attaching fails
    try:
        with patcher.all_or_nothing():
            return _attach(scheduler, runtime, patcher, started)
    except BaseException:
        for worker in reversed(started):
            worker.stop()
        raise


def _attach(scheduler: Any, runtime: Runtime, patcher: Patcher, started: list[Any]) -> UpkeepThread:
    settings = runtime.settings
    check_offload_owner(scheduler.connector, settings.cpu_bytes)
    lock = threading.RLock()
    connection = _connect(scheduler, runtime, lock)
    cache, mapper = connection.cache, connection.mapper
    mapper.start()
    started.append(mapper)
    manager = scheduler.kv_cache_manager
    block_pool = manager.block_pool
    ahead = max(1, settings.prefetch_bytes // max(1, cache.group_bytes))
    queue = make_page_aware(block_pool, cache, mapper, patcher=patcher, max_ahead_groups=ahead,
                            keep_free_order=may_walk_free_queue(scheduler.connector))
    queue.transfers_in_flight = transfers_in_flight(scheduler, patcher)
    guard = commit_guard.install(manager.coordinator, queue, patcher)
    plan = _host_plan(scheduler, connection) if settings.cpu_bytes else None
    offload = _attach_offload(scheduler, block_pool, queue, connection, settings, plan, patcher)
    if offload is not None and plan is not None and plan.loads_beside_compute:
        _attach_host_loads(scheduler, offload, block_pool, patcher)
    _lock_entry_points(scheduler, patcher, lock, guard, offload, connection.step_hook(scheduler, queue))
    reply_hook = connection.reply_hook()
    if reply_hook is not None:  # under tensor parallelism, confirmations on the steps' replies
        patcher.wrap_instance(scheduler, UPDATE_FROM_OUTPUT, reading_wrapper(lock, reply_hook))
    _wake_for_idle_work(scheduler, patcher, connection.idle_work())
    link = connection.join_account(scheduler, runtime)
    reclaimer = engine_upkeep(queue, cache, lock, cache_ttl_s=settings.cache_ttl_s,
                              reserve_bytes=settings.reserve_bytes, offload=offload, link=link,
                              publisher=_publisher(link, scheduler),
                              rank_held_bytes=connection.rank_held_bytes,
                              after_tick=runtime.retire_unused_pools,
                              reloads=_reload_reserve(offload, cache))
    patcher.add_attribute(scheduler, "kvelastic_reclaimer", reclaimer)
    _attach_hibernation(scheduler, connection, queue, reclaimer, lock, patcher, offload, link)
    reclaimer.start()
    started.append(reclaimer)
    log.info("kvelastic: scheduler block pool is page-aware: %d blocks in %d groups of %d blocks",
             cache.num_blocks, cache.num_groups, cache.blocks_per_group)
    return reclaimer


def _attach_hibernation(scheduler: Any, connection: CacheConnection, queue: PageAwareFreeQueue,
                        upkeep: UpkeepThread, lock: threading.RLock, patcher: Patcher,
                        offload: OffloadManager | None, link: AccountLink | None) -> None:
    """What vLLM's sleep and ``release_kv_cache_memory`` call on (``patches/sleep_mode.py``): the engine's
    pages (and host-tier copies) given back, where its pool is in this process; None under worker ranks,
    where both are refused."""
    from kvelastic.patches.sleep_mode import HIBERNATION_ATTRIBUTE
    from kvelastic.scheduler.hibernation import Hibernation

    hibernation = None
    if connection.unmaps_between_steps:
        hibernation = Hibernation(queue, connection.cache, connection.mapper, upkeep, lock,
                                  drop_host_copies=None if offload is None else offload.reset,
                                  withdraw_want=None if link is None else link.withdraw_want)
    patcher.add_attribute(scheduler, HIBERNATION_ATTRIBUTE, hibernation)


def _connect(scheduler: Any, runtime: Runtime, lock: threading.RLock) -> CacheConnection:
    """Where the KV cache is, decided once: in this process, or (none here) on the worker ranks."""
    if runtime.cache is not None:
        return LocalConnection.of(runtime, runtime.cache)
    from kvelastic.tp.scheduler_side import connect_ranks

    return connect_ranks(scheduler, runtime, lock)


def _lock_entry_points(scheduler: Any, patcher: Patcher, lock: threading.RLock, guard: CommitGuard,
                       offload: OffloadManager | None, step_hook: Callable[[Any], None] | None) -> None:
    """Each declared entry point runs under ``lock``, then what must follow it before the lock is let go.

    No host copy outlives a call (``offload.flush``; after ``schedule()``,
    ``offload.end_step`` also issues the write-through stores due); what was secured for a
    step's allocations is not held past it (``guard.end_step``); a reset that vLLM
    carried out drops the host copies too and hooks the host tier into the new
    prefix-cache map (one vLLM declined leaves both as they were: it declines while
    host loads hold blocks, so a reset never waits for a load); ``step_hook`` gets
    each ``schedule()`` output last (under tensor parallelism: the ranks' commands).
    """
    flush = offload.flush if offload is not None else None
    for target in LOCKED:
        then = flush
        on_result = step_hook if target is SCHEDULE else None
        if target is SCHEDULE:  # the step's write-through stores go out after its spills and loads
            then = _chain(guard.end_step, offload.end_step if offload is not None else None)
        if target is RESET_PREFIX_CACHE and offload is not None:
            on_result = functools.partial(_reset_host_copies, offload)
        patcher.wrap_instance(scheduler, target, locked_wrapper(lock, then, on_result))


def _wake_for_idle_work(scheduler: Any, patcher: Patcher, idle: "IdleSteps | None") -> None:
    """Where commands wait for idle ranks (tensor parallelism), ``has_requests()`` says so: vLLM's
    engine loop, once woken, then runs a step with no tokens that carries them (:mod:`kvelastic.tp.idle_steps`).
    Not locked: it is read between steps, and a stale answer costs one empty step or waits for the next.
    The wake-up goes on the scheduler, where the engine loop's wrap (``patches/engine_core_wake.py``) finds it."""
    if idle is None:
        return
    from kvelastic.patches.engine_core_wake import WAKE_ATTRIBUTE, has_requests_target

    patcher.wrap_instance(scheduler, has_requests_target(patcher), functools.partial(_or_idle_work, idle.waiting))
    patcher.add_attribute(scheduler, WAKE_ATTRIBUTE, idle.wake)


def _or_idle_work(idle_work: Callable[[], bool], wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> bool:
    return bool(wrapped(*args, **kwargs)) or idle_work()


def _reset_host_copies(offload: OffloadManager, reset: Any) -> None:
    """After ``reset_prefix_cache``: where vLLM reset its prefix cache, the host tier's copies go too."""
    if reset:
        offload.reset()


def _host_plan(scheduler: Any, connection: CacheConnection) -> HostPlan:
    """The host tier's plan for this engine, from where its KV cache lives; logged once."""
    connector = scheduler.connector
    plan = host_plan(cache_in_process=connection.unmaps_between_steps, loads_reported=connection.async_loads,
                     vllm_connector=None if connector is None else type(connector).__name__)
    log.info("kvelastic: host tier: %s", plan.describe())
    return plan


def _attach_offload(scheduler: Any, block_pool: Any, queue: PageAwareFreeQueue, connection: CacheConnection,
                    settings: Settings, plan: HostPlan | None, patcher: Patcher) -> OffloadManager | None:
    """The host tier running ``plan``, where ``KVELASTIC_CPU_BYTES`` asks for one (None otherwise). GPU
    prefix misses the host holds become hits loaded in front of the step, unless the plan loads them
    beside compute (the connector serves them then)."""
    if plan is None:
        return None
    from kvelastic.hooks.offload_setup import wire_offload

    offload = wire_offload(block_pool, queue, *connection.host_tier(settings, plan), patcher, plan,
                           serve_misses=not plan.loads_beside_compute)
    patcher.add_attribute(scheduler, "kvelastic_offload", offload)
    return offload


def _reload_reserve(offload: OffloadManager | None, cache: Any) -> "ReloadReserve | None":
    """What sizes the warm reserve for host-tier reloads, with a host tier."""
    if offload is None:
        return None
    from kvelastic.scheduler.reload_reserve import ReloadReserve

    tier = offload.tier
    return ReloadReserve(offload.runs, cache, lambda: tier.stats().slots_used)


def _attach_host_loads(scheduler: Any, offload: OffloadManager, block_pool: Any, patcher: Patcher) -> None:
    """Host hits load while their request waits, or in front of the step where the request is alone. The
    finished loads reach vLLM in ``update_from_output``'s input, fed inside the lock taken around it
    (wrapped here, before the lock's wrapper goes around it)."""
    from kvelastic.hooks.host_loads import InFrontWhenAlone, attach_host_loads, feeding_wrapper
    from kvelastic.hooks.offload_setup import hook_lookup

    connector = attach_host_loads(scheduler, offload, patcher)
    patcher.wrap_instance(scheduler, UPDATE_FROM_OUTPUT, feeding_wrapper(connector, scheduler))
    hook_lookup(block_pool, offload, patcher, serve_when=InFrontWhenAlone(scheduler, connector.loads))


def _publisher(link: Any, scheduler: Any) -> Any:
    """The metrics snapshot writer, named like the engine's account membership, with vLLM's model name."""
    import os

    from kvelastic.metrics.metrics import StatsPublisher

    model_name = scheduler.vllm_config.model_config.served_model_name
    publisher = StatsPublisher(link.name if link is not None else f"engine-{os.getpid()}",
                               model_name=str(model_name or ""))
    import atexit

    atexit.register(publisher.remove)
    return publisher


def locked_wrapper(lock: ContextManager, then: Callable[[], None] | None = None,
                   on_result: Callable[[Any], None] | None = None) -> Callable[..., Any]:
    """A wrapper (wrapt's form) that calls the wrapped method under ``lock``, then ``then()``, then
    ``on_result`` with what it returned, all before the lock is let go."""
    return functools.partial(_locked, lock, then, on_result)


def _locked(lock: ContextManager, then: Callable[[], None] | None, on_result: Callable[[Any], None] | None,
            wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    with lock:
        result = wrapped(*args, **kwargs)
        if then is not None:
            then()
        if on_result is not None:
            on_result(result)
        return result


def reading_wrapper(lock: ContextManager, read: Callable[[Any], None]) -> Callable[..., Any]:
    """A wrapper (wrapt's form) for ``update_from_output`` that gives ``read`` the step's model output
    under ``lock``, before vLLM sees it."""
    return functools.partial(_read_first, lock, read)


def _read_first(lock: ContextManager, read: Callable[[Any], None], wrapped: Any, instance: Any, args: tuple,
                kwargs: dict) -> Any:
    output = argument(wrapped, args, kwargs, "model_runner_output")
    with lock:
        read(output)
        return wrapped(*args, **kwargs)


def _chain(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    """``first()`` then ``then()`` (where there is one), as one callable."""
    if then is None:
        return first

    def both() -> None:
        first()
        then()

    return both
