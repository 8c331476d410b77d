"""Connect an engine's scheduler to worker ranks running in other processes.

Called by ``attach_scheduler`` when its process holds no KV cache: the ranks
(children of this engine-core process) have already allocated their caches and
described them in the engine's folder. Builds the remote mapper and sharded
cache view, and the step hook that attaches each step's commands to its
``SchedulerOutput``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
from typing import Any, Callable

from kvelastic.errors import PatchError
from kvelastic.pool.backend import DoneFence
from kvelastic.tp import board as shm
from kvelastic.tp.remote_mapper import RemoteMapper
from kvelastic.tp.sharded_cache import ShardedKVCache

log = logging.getLogger("vllm.kvelastic")

RANKS_WAIT_S = 30.0


def connect_ranks(scheduler: Any, runtime: Any, wait_s: float | None = None) -> tuple[ShardedKVCache, RemoteMapper]:
    """The ranks' caches, found through the engine's folder; PatchError if they never show up."""
    wait_s = RANKS_WAIT_S if wait_s is None else wait_s
    parallel = scheduler.vllm_config.parallel_config  # fields declared in patches/engine_config.py
    world = int(parallel.world_size)
    if int(parallel.pipeline_parallel_size) > 1:
        raise PatchError("kvelastic: pipeline parallelism is not supported (each stage holds different "
                         "layers); run with pipeline_parallel_size=1, or set KVELASTIC=0")
    folder = shm.engine_dir(os.getpid())
    infos = _wait_for_ranks(folder, world, wait_s)
    cache, mapper = connect_boards(folder, infos, runtime.settings.limit_bytes)
    atexit.register(_remove_idle_files, folder)
    log.info("kvelastic: scheduler drives %d worker ranks through %s", world, folder)
    return cache, mapper


def connect_boards(folder: Any, infos: list[shm.RankInfo],
                   limit_bytes: int | None = None) -> tuple[ShardedKVCache, RemoteMapper]:
    """The scheduler's view of ranks that described themselves in ``folder``.

    Groups mapped on every rank at start-up are adopted; a group mapped on
    only some ranks is unmapped with the first step. ``limit_bytes`` (the
    user's) overrides the smallest limit the ranks profiled.
    """
    first = infos[0]
    if any(i.layout.num_groups != first.layout.num_groups or i.layout.blocks_per_group
           != first.layout.blocks_per_group for i in infos):
        raise PatchError("kvelastic: the worker ranks laid out their KV caches differently; "
                         "every rank must hold the same blocks")
    groups = range(first.layout.num_groups)
    boards = [shm.RankBoard.of_rank(folder, i.rank, first.layout.num_groups, create=False) for i in infos]
    mapper = RemoteMapper(folder, boards, [g for g in groups if all(int(b.groups[g]) > 0 for b in boards)])
    mapper.request_unmap([g for g in groups if g not in mapper.mapped_groups
                          and any(int(b.groups[g]) > 0 for b in boards)])
    limits = [i.limit_bytes for i in infos if i.limit_bytes]
    cache = ShardedKVCache(mapper, infos, limit_bytes or (min(limits) if limits else None))
    return cache, mapper


def _remove_idle_files(folder: Any) -> None:
    for _, _, path in shm.idle_files(folder):
        path.unlink(missing_ok=True)
    try:
        folder.rmdir()  # the ranks remove their own files; the last one out removes the folder
    except OSError:
        pass


def _wait_for_ranks(folder: Any, world: int, wait_s: float) -> list[shm.RankInfo]:
    deadline = time.monotonic() + wait_s
    while True:
        infos = [shm.read_info(folder, r) for r in range(world)]
        if all(infos):
            return infos  # type: ignore[return-value]
        if time.monotonic() > deadline:
            missing = [r for r, i in enumerate(infos) if i is None]
            raise PatchError(
                f"kvelastic: the scheduler found no elastic KV cache in its process and worker ranks "
                f"{missing} of {world} did not describe theirs in {folder}. The executor is not one "
                f"kvelastic supports (use the default uniprocess or multiprocess executor, not Ray), or "
                f"the workers run without KVELASTIC=1; or set KVELASTIC=0 for this engine")
        time.sleep(0.05)


def demand_of(scheduler: Any) -> int:
    """Blocks the requests need soon: what each still has to compute, at least one per running one.

    Waiting requests count in full, so one miss maps for the whole queue at
    once; a running request still in (chunked) prefill counts its remaining
    prompt, a decoding one its next block. Without the running requests'
    share, a chunk would find no mapped block and vLLM would preempt. What is
    read (the queues, the block size, the requests' token counts) is declared
    in ``patches/scheduler_block_pool.py``.
    """
    block = int(scheduler.cache_config.block_size)
    blocks = sum(max(1, _blocks_left(request, block)) for request in scheduler.running)
    return blocks + sum(_blocks_left(request, block) for request in scheduler.waiting)


def _blocks_left(request: Any, block: int) -> int:
    return -(-max(0, request.num_tokens - request.num_computed_tokens) // block)


def locked_schedule(lock: Any, flush: Callable[[], None] | None, mapper: RemoteMapper, queue: Any,
                    scheduler: Any) -> Callable[..., Any]:
    """A wrapper (wrapt's form) for ``schedule``: under the lock; the step's output then carries every
    command queued so far, as ``kvelastic_plan``."""
    return functools.partial(_schedule, lock, flush, mapper, queue, scheduler)


def _schedule(lock: Any, flush: Callable[[], None] | None, mapper: RemoteMapper, queue: Any, scheduler: Any,
              wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    with lock:
        output = wrapped(*args, **kwargs)
        if flush is not None:
            flush()
        queue.want_blocks(demand_of(scheduler))
        output.kvelastic_plan = mapper.take_plan()
        return output


class RemoteCopier:
    """The copier interface of the offload manager, as commands every rank runs on its own shard."""

    def __init__(self, mapper: RemoteMapper, bytes_per_block: int):
        self.mapper = mapper
        self.bytes_per_block = bytes_per_block

    def store(self, block_ids: Any, slots: Any, *, block_compute: bool = False) -> DoneFence:
        if block_ids:
            self.mapper.request_store(block_ids, slots, block_compute)
        return DoneFence()  # each rank orders the copy before any later unmap of those blocks

    def load(self, block_ids: Any, slots: Any) -> DoneFence:
        if block_ids:
            self.mapper.request_load(block_ids, slots)
        return DoneFence()


def attach_remote_offload(block_pool: Any, queue: Any, cache: ShardedKVCache, mapper: RemoteMapper,
                          patcher: Any, policy: str = "arc") -> Any:
    """The host-tier index on the scheduler; the slots' memory is one pinned buffer per rank."""
    from kvelastic.integration.offload_setup import block_entry, hook_lookup
    from kvelastic.offload.host_tier import HostTier
    from kvelastic.offload.manager import OffloadManager

    if not cache.host_slots:
        raise PatchError("kvelastic: KVELASTIC_CPU_BYTES is set for the scheduler but the worker ranks "
                         "set up no host tier; give every process of the engine the same environment")
    slot_bytes = cache.info.slot_bytes * cache.world
    tier = HostTier(cache.host_slots * slot_bytes, slot_bytes, pin=False, allocate=False, policy=policy)
    manager = OffloadManager(tier, RemoteCopier(mapper, slot_bytes), queue, block_entry(block_pool, patcher))
    queue.spill_hook = manager.spill
    hook_lookup(block_pool, manager, patcher)
    return manager
