"""Attach a vLLM scheduler to the elastic KV cache of its engine.

Called right after ``Scheduler.__init__``: the GPU block pool becomes
page-aware, the scheduler's entry points that touch the block pool take one
lock (shared with the reclaimer thread), and the reclaimer starts. The cache
is in this process (one GPU, uniprocess executor) or sharded over worker ranks
in child processes (tensor parallelism, multiprocess executor: see
:mod:`kvelastic.tp`).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from kvelastic.integration import commit_guard
from kvelastic.integration.block_pool import make_page_aware
from kvelastic.integration.mapper import GroupMapper
from kvelastic.integration.runtime import Runtime
from kvelastic.integration.upkeep import UpkeepThread, engine_upkeep
from kvelastic.settings import Settings

log = logging.getLogger("vllm.kvelastic")

#: Scheduler methods that read or change the GPU block pool, called by the engine thread.
LOCKED_METHODS = ("schedule", "update_from_output", "finish_requests", "reset_prefix_cache")


def attach_scheduler(scheduler: Any, runtime: Runtime) -> UpkeepThread:
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
    block_pool = scheduler.kv_cache_manager.block_pool
    ahead = max(1, settings.prefetch_bytes // max(1, cache.group_bytes))
    queue = make_page_aware(block_pool, cache, mapper, max_ahead_groups=ahead)
    guard = commit_guard.install(scheduler.kv_cache_manager.coordinator, queue)
    lock = threading.RLock()
    offload = _attach_offload(scheduler, block_pool, queue, cache, mapper, remote, settings)
    for name in LOCKED_METHODS:
        method = getattr(scheduler, name, None)
        if method is None:
            continue
        after = _after_reset(block_pool, offload) if name == "reset_prefix_cache" else None
        flush = offload.flush if offload is not None else None  # no copy outlives a call
        if name == "schedule":  # what was secured for this step's allocations is not held past it
            flush = _chain(guard.end_step, flush)
        if remote and name == "schedule":
            from kvelastic.tp.scheduler_side import locked_schedule

            setattr(scheduler, name, locked_schedule(lock, method, flush, mapper, queue, scheduler))
        else:
            setattr(scheduler, name, _locked(lock, method, after or flush))
    if remote:
        cache.pool.lock = lock  # idle delivery of commands must not race a scheduling step
    link = None if remote else _join_cluster(scheduler, runtime, cache, limit)
    reclaimer = engine_upkeep(queue, cache, lock, cache_ttl_s=settings.cache_ttl_s,
                              reserve_bytes=settings.reserve_bytes, offload=offload, link=link,
                              publisher=_publisher(link, scheduler),
                              rank_held_bytes=mapper.rank_held_bytes if remote else None,
                              after_tick=runtime.retire_unused_pools)
    reclaimer.start()
    scheduler.kvelastic_reclaimer = reclaimer
    log.info("kvelastic: scheduler block pool is page-aware: %d blocks in %d groups of %d blocks",
             cache.num_blocks, cache.num_groups, cache.blocks_per_group)
    return reclaimer


def _attach_offload(scheduler: Any, block_pool: Any, queue: Any, cache: Any, mapper: Any, remote: bool,
                    settings: Settings) -> Any:
    """The host tier, where ``KVELASTIC_CPU_BYTES`` asks for one; None otherwise."""
    if not settings.cpu_bytes:
        return None
    if remote:
        from kvelastic.tp.scheduler_side import attach_remote_offload

        offload = attach_remote_offload(block_pool, queue, cache, mapper, policy=settings.cpu_policy)
    else:
        from kvelastic.integration.offload_setup import attach_offload

        offload = attach_offload(block_pool, queue, cache, settings.cpu_bytes, policy=settings.cpu_policy,
                                 copy_path=settings.copy_path)
    scheduler.kvelastic_offload = offload
    return offload


def _publisher(link: Any, scheduler: Any) -> Any:
    """The metrics snapshot writer, named like the engine's account membership, with vLLM's model name."""
    import os

    from kvelastic.integration.metrics import StatsPublisher

    model_config = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    publisher = StatsPublisher(link.name if link is not None else f"engine-{os.getpid()}",
                               model_name=str(getattr(model_config, "served_model_name", "") or ""))
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

    model = str(getattr(getattr(scheduler.vllm_config, "model_config", None), "model", "") or "")
    try:
        return ClusterLink(cache, source, runtime.settings, model, limit)
    except NameInUse:
        raise  # a configuration error the user must fix: two live engines with one name
    except Exception as exc:  # noqa: BLE001 - sharing is an addition; serving must not depend on it
        log.warning("kvelastic: could not join this GPU's shared KV account (%s); this engine runs "
                    "with its own limit only", exc)
        return None


def _locked(lock: threading.RLock, method: Any, then: Any = None) -> Any:
    """``method`` under ``lock``; ``then()`` runs after it, still under the lock."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with lock:
            result = method(*args, **kwargs)
            if then is not None:
                then()
            return result

    return call


def _chain(first: Any, then: Any) -> Any:
    """``first()`` then ``then()`` (where there is one), as one callable."""
    if then is None:
        return first

    def both() -> None:
        first()
        then()

    return both


def _after_reset(block_pool: Any, offload: Any) -> Any:
    """A reset replaces the prefix-cache map, so the host-tier lookup must be hooked again."""
    if offload is None:
        return None
    from kvelastic.integration.offload_setup import hook_lookup

    def after() -> None:
        offload.reset()
        hook_lookup(block_pool, offload)

    return after
