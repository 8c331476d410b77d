"""Set up a worker rank whose scheduler runs in another process (TP or PP: multiprocess executor, Ray V2).

Runs right after the rank has published its elastic KV cache: describes it in
the engine's folder, allocates this rank's share of the host tier (pinned in
the background; the rank publishes its progress on its board and in its step
reports, and the scheduler hands out a slot once every rank has it) and starts
the :class:`~kvelastic.tp.rank.RankWorker` that the patched
``Worker.execute_model`` feeds each step's commands.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvelastic.cluster.device import device_identity
from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.settings import Settings
from kvelastic.tp import board as shm
from kvelastic.tp import engine_folder
from kvelastic.tp.engine_folder import keep_description, rank_folder
from kvelastic.tp.rank import RankWorker

if TYPE_CHECKING:
    from kvelastic.startup.runtime import Runtime
    from kvelastic.offload.copier import BlockCopier
    from kvelastic.offload.host_memory import HostMemory

log = logging.getLogger("vllm.kvelastic")


def scheduler_elsewhere(runner: Any) -> bool:
    """True when this worker's scheduler lives in another process: its parent (vLLM's multiprocess
    executor) or, under Ray, the engine core that handed it the folder (:mod:`kvelastic.tp.engine_folder`)."""
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
    engine = rank_folder(runner.vllm_config.parallel_config.distributed_executor_backend)
    worker = start_rank(cache, engine.folder, rank, world, runtime.limit_bytes, settings.cpu_bytes,
                        map_after_launch=settings.tp_map_after_launch)
    runtime.rank_worker = worker
    where = worker.folder or "no folder (another host: its description, reports and commands ride vLLM's calls)"
    log.info("kvelastic: rank %d of %d serves its scheduler (pid %d) through %s", rank, world,
             engine.engine_pid, where)
    return worker


def start_rank(cache: ElasticKVCache, folder: Path | None, rank: int, world: int, limit_bytes: int | None,
               cpu_bytes: int | None, map_after_launch: bool = Settings.tp_map_after_launch) -> RankWorker:
    """Describe this rank's cache in ``folder`` (None: on another host, nowhere but in memory), set up its
    host-tier share, start its worker (``map_after_launch``: its steps' MAPs wait for the forward pass's launch)."""
    copier, memory, slot_bytes = None, None, 0
    if cpu_bytes:
        copier, memory, slot_bytes = _host_share(cache, cpu_bytes, world)
    gpu_id, gpu_total = device_identity(cache.pool.backend)
    info = shm.RankInfo(rank=rank, world=world, pid=os.getpid(), layout=cache.layout,
                        group_bytes=cache.group_bytes, page_bytes=cache.pool.page_bytes,
                        limit_bytes=limit_bytes, host_slots=memory.slots if memory else 0, slot_bytes=slot_bytes,
                        gpu_id=gpu_id, gpu_total=gpu_total or 0, host=engine_folder.host_identity())
    worker = RankWorker(cache, folder, info, copier, map_after_launch=map_after_launch)
    keep_description(worker.info)  # with its start-up state; under Ray the engine core asks for it
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
