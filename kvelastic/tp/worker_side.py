"""Set up a worker rank whose scheduler runs in another process (TP or PP: multiprocess executor, Ray V2).

Runs right after the rank has published its elastic KV cache: keeps its
description for the engine core, which asks for it over vLLM's
``collective_rpc`` (:mod:`kvelastic.tp.rank_handover`), allocates this rank's
share of the host tier (pinned in the background; the rank reports its progress
on the steps' replies, and the scheduler hands out a slot once every rank has
it) and starts the :class:`~kvelastic.tp.rank.RankWorker` that the patched
``Worker.execute_model`` feeds each step's commands. The rank opens nothing in
the shared folder, so a folder another user squats, or a full ``/dev/shm``,
never stops it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from kvelastic.cluster.device import device_identity
from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.tp import rank_handover
from kvelastic.tp.rank import RankWorker
from kvelastic.tp.rank_info import RankInfo

if TYPE_CHECKING:
    from kvelastic.startup.runtime import Runtime
    from kvelastic.offload.copier import BlockCopier
    from kvelastic.offload.host_memory import HostMemory

log = logging.getLogger("vllm.kvelastic")


def scheduler_elsewhere(runner: Any) -> bool:
    """True when this worker's scheduler lives in another process: its parent (vLLM's multiprocess
    executor) or, under Ray, the engine core that said it drives it (:mod:`kvelastic.tp.rank_handover`)."""
    return runner.vllm_config.parallel_config.distributed_executor_backend in ("mp", "ray")


def rank_and_world(runner: Any) -> tuple[int, int]:
    parallel = runner.vllm_config.parallel_config
    world = int(parallel.world_size)
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), world


def serve_as_rank(runtime: "Runtime", runner: Any, cache: ElasticKVCache) -> RankWorker:
    rank, world = rank_and_world(runner)
    settings = runtime.settings
    engine_pid = rank_handover.engine_core(runner.vllm_config.parallel_config.distributed_executor_backend)
    worker = start_rank(cache, rank, world, runtime.limit_bytes, settings.cpu_bytes)
    runtime.rank_worker = worker
    log.info("kvelastic: rank %d of %d serves its scheduler (pid %d) over vLLM's calls", rank, world, engine_pid)
    return worker


def start_rank(cache: ElasticKVCache, rank: int, world: int, limit_bytes: int | None,
               cpu_bytes: int | None) -> RankWorker:
    """Describe this rank's cache (kept for the engine core to ask for), set up its host-tier share, start
    its worker."""
    copier, memory, slot_bytes = None, None, 0
    if cpu_bytes:
        copier, memory, slot_bytes = _host_share(cache, cpu_bytes, world)
    gpu_id, gpu_total = device_identity(cache.pool.backend)
    info = RankInfo(rank=rank, world=world, pid=os.getpid(), layout=cache.layout,
                    group_bytes=cache.group_bytes, page_bytes=cache.pool.page_bytes,
                    limit_bytes=limit_bytes, host_slots=memory.slots if memory else 0, slot_bytes=slot_bytes,
                    gpu_id=gpu_id, gpu_total=gpu_total or 0, host=rank_handover.host_identity())
    worker = RankWorker(cache, info, copier)
    rank_handover.keep_description(worker.describe)  # what the engine core asks for once vLLM's start-up is over
    if memory is not None:
        memory.watch(worker.pinned)
        worker.at_first_step(memory.begin)  # not while vLLM captures CUDA graphs (HostMemory's docstring)
    worker.start()
    return worker


def _host_share(cache: ElasticKVCache, cpu_bytes: int,
                world: int) -> tuple["BlockCopier | None", "HostMemory | None", int]:
    """This rank's slots, pinned in the background: ``KVELASTIC_CPU_BYTES`` covers all ranks together. Its
    copier has no staging buffers: a rank stores as blocks leave the GPU, and its loads take its own path."""
    from kvelastic.hooks.offload_setup import BlockRows
    from kvelastic.offload.host_tier import allocate_slots

    rows = BlockRows(cache)
    slots = cpu_bytes // (rows.slot_bytes * world)
    if slots < 1:
        return None, None, rows.slot_bytes
    memory = allocate_slots(slots, rows.slot_bytes, pin=rows.pin, deferred=True)
    return rows.copier(memory), memory, rows.slot_bytes
