"""Attach a vLLM scheduler to the elastic KV cache of its engine.

Called right after ``Scheduler.__init__``: the GPU block pool becomes
page-aware, the scheduler's entry points that touch the block pool take one
lock (shared with the reclaimer thread), and the reclaimer starts. The cache
is in this process (one GPU, uniprocess executor) or sharded over worker ranks
in child processes (tensor parallelism, multiprocess executor: see
:mod:`kvelastic.tp`).

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
from typing import Any, Callable

from kvelastic.integration import commit_guard
from kvelastic.integration.block_pool import make_page_aware
from kvelastic.integration.mapper import GroupMapper
from kvelastic.integration.runtime import Runtime
from kvelastic.integration.upkeep import UpkeepThread, engine_upkeep
from kvelastic.patches.scheduler_block_pool import LOCKED, RESET_PREFIX_CACHE, SCHEDULE
from kvelastic.patching.apply import Patcher
from kvelastic.settings import Settings

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
    cache = runtime.cache
    remote = cache is None
    if remote:
        from kvelastic.tp.scheduler_side import connect_ranks

        cache, mapper = connect_ranks(scheduler, runtime)
        limit = cache.pool.limit_bytes
    else:
        limit = runtime.plan.limit_bytes if runtime.plan else settings.limit_bytes
        cache.pool.set_limit(limit)  # start-up warm-up ran unlimited; from here the limit holds
        mapper = GroupMapper(cache)
        mapper.start()
    started.append(mapper)
    manager = scheduler.kv_cache_manager
    block_pool = manager.block_pool
    ahead = max(1, settings.prefetch_bytes // max(1, cache.group_bytes))
    queue = make_page_aware(block_pool, cache, mapper, patcher=patcher, max_ahead_groups=ahead)
    guard = commit_guard.install(manager.coordinator, queue, patcher)
    lock = threading.RLock()
    offload = _attach_offload(scheduler, block_pool, queue, cache, mapper, remote, settings, patcher)
    _lock_entry_points(scheduler, patcher, lock, guard, offload, queue if remote else None, mapper)
    if remote:
        cache.pool.lock = lock  # idle delivery of commands must not race a scheduling step
    link = None if remote else _join_cluster(scheduler, runtime, cache, limit)
    reclaimer = engine_upkeep(queue, cache, lock, cache_ttl_s=settings.cache_ttl_s,
                              reserve_bytes=settings.reserve_bytes, offload=offload, link=link,
                              publisher=_publisher(link, scheduler),
                              rank_held_bytes=mapper.rank_held_bytes if remote else None,
                              after_tick=runtime.retire_unused_pools)
    patcher.add_attribute(scheduler, "kvelastic_reclaimer", reclaimer)
    reclaimer.start()
    started.append(reclaimer)
    log.info("kvelastic: scheduler block pool is page-aware: %d blocks in %d groups of %d blocks",
             cache.num_blocks, cache.num_groups, cache.blocks_per_group)
    return reclaimer


def _lock_entry_points(scheduler: Any, patcher: Patcher, lock: threading.RLock, guard: Any, offload: Any,
                       remote_queue: Any, mapper: Any) -> None:
    """Each declared entry point runs under ``lock``, then what must follow it before the lock is let go.

    No host copy outlives a call (``offload.flush``); what was secured for a
    step's allocations is not held past it (``guard.end_step``); a reset hooks
    the host tier into the new prefix-cache map. Under tensor parallelism
    (``remote_queue`` given) the step's output also carries the ranks' commands.
    """
    flush = offload.flush if offload is not None else None
    for target in LOCKED:
        then = flush
        if target is SCHEDULE:
            then = _chain(guard.end_step, flush)
        if target is RESET_PREFIX_CACHE and offload is not None:
            then = offload.reset  # the host copies go too; the lookup hook follows the new map
        if remote_queue is not None and target is SCHEDULE:
            from kvelastic.tp.scheduler_side import locked_schedule

            wrapper = locked_schedule(lock, then, mapper, remote_queue, scheduler)
        else:
            wrapper = functools.partial(_locked, lock, then)
        patcher.wrap_instance(scheduler, target, wrapper)


def _attach_offload(scheduler: Any, block_pool: Any, queue: Any, cache: Any, mapper: Any, remote: bool,
                    settings: Settings, patcher: Patcher) -> Any:
    """The host tier, where ``KVELASTIC_CPU_BYTES`` asks for one; None otherwise."""
    if not settings.cpu_bytes:
        return None
    if remote:
        from kvelastic.tp.scheduler_side import attach_remote_offload

        offload = attach_remote_offload(block_pool, queue, cache, mapper, patcher, policy=settings.cpu_policy)
    else:
        from kvelastic.integration.offload_setup import attach_offload

        offload = attach_offload(block_pool, queue, cache, settings.cpu_bytes, patcher, policy=settings.cpu_policy,
                                 copy_path=settings.copy_path)
    patcher.add_attribute(scheduler, "kvelastic_offload", offload)
    return offload


def _publisher(link: Any, scheduler: Any) -> Any:
    """The metrics snapshot writer, named like the engine's account membership, with vLLM's model name."""
    import os

    from kvelastic.integration.metrics import StatsPublisher

    model_name = scheduler.vllm_config.model_config.served_model_name
    publisher = StatsPublisher(link.name if link is not None else f"engine-{os.getpid()}",
                               model_name=str(model_name or ""))
    import atexit

    atexit.register(publisher.remove)
    return publisher


def _join_cluster(scheduler: Any, runtime: Runtime, cache: Any, limit: int | None) -> Any:
    """Join the GPU's shared account; None where the pool has no shared-budget gate."""
    source = runtime.budget
    if source is None:
        return None
    from kvelastic.cluster.errors import NameInUse
    from kvelastic.integration.cluster_link import ClusterLink

    model = str(scheduler.vllm_config.model_config.model or "")
    try:
        return ClusterLink(cache, source, runtime.settings, model, limit)
    except NameInUse:
        raise  # a configuration error the user must fix: two live engines with one name
    except Exception as exc:  # noqa: BLE001 - sharing is an addition; serving must not depend on it
        log.warning("kvelastic: could not join this GPU's shared KV account (%s); this engine runs "
                    "with its own limit only", exc)
        return None


def _locked(lock: threading.RLock, then: Callable[[], None] | None, wrapped: Any, instance: Any,
            args: tuple, kwargs: dict) -> Any:
    """``wrapped`` under ``lock``; ``then()`` runs after it, still under the lock."""
    with lock:
        result = wrapped(*args, **kwargs)
        if then is not None:
            then()
        return result


def _chain(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    """``first()`` then ``then()`` (where there is one), as one callable."""
    if then is None:
        return first

    def both() -> None:
        first()
        then()

    return both
