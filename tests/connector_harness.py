"""vLLM's real scheduler with one of vLLM's offload connectors, and a stand-in for its worker side.

The scheduler and the connector's scheduler side are vLLM's own; only the
worker is stood in for (its copies need CUDA): each step it reports every
transfer the previous step's connector metadata asked for as done, one step
later, as the real worker does at the earliest. It keeps the GPU blocks of the
transfers in flight, so a test can check that their groups stay mapped while
the copy may run, and counts what was stored and loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvelastic_dev.connector_transfers import is_simple, transfers_of
from tests.kv_fixtures import BS, D, H, N, kv_cache_tensors
from tests.scheduler_harness import MODEL, model_output, step_of

#: (connector, extra config) per mode; the CPU side holds 512 blocks (more than any test stores).
CPU_BLOCKS = 512
MODES: dict[str, tuple[str, dict]] = {
    "simple-eager": ("SimpleCPUOffloadConnector", {}),
    "simple-lazy": ("SimpleCPUOffloadConnector", {"lazy_offload": True}),
    "simple-disk": ("SimpleCPUOffloadConnector", {"kv_offload_backend": "disk", "disk_path": "/nonexistent/kv"}),
    "offload-lru": ("OffloadingConnector", {"block_size": BS, "eviction_policy": "lru"}),
    "offload-arc": ("OffloadingConnector", {"block_size": BS, "eviction_policy": "arc"}),
}


def page_bytes() -> int:
    return kv_spec().page_size_bytes


def kv_spec():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)


def connector_config(mode: str, **extra: Any):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)

    name, mode_extra = MODES[mode]
    cpu_bytes = CPU_BLOCKS * 3 * page_bytes()  # three layers
    if mode_extra.get("kv_offload_backend") == "disk":  # the scheduler side never opens the file
        mode_extra = {**mode_extra, "disk_capacity_bytes": cpu_bytes}
    model = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16", seed=0)
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                                is_encoder_decoder=False, enable_chunked_prefill=True)
    transfer = KVTransferConfig(kv_connector=name, kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes, **mode_extra, **extra})
    config = VllmConfig(model_config=model, scheduler_config=scheduler, kv_transfer_config=transfer,
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                        device_config=DeviceConfig(device="cpu"))
    config.cache_config.num_gpu_blocks = N
    return config


def make_connector_scheduler(mode: str, **extra: Any):
    """vLLM's Scheduler with the connector of ``mode``; its KV config has the fixture's three layers."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = connector_config(mode, **extra)
    layers = ["l0", "l1", "l2"]
    kv_config = KVCacheConfig(num_blocks=N, kv_cache_tensors=kv_cache_tensors(layers, N, page_bytes()),
                              kv_cache_groups=[KVCacheGroupSpec(layers, kv_spec())])
    return Scheduler(vllm_config=config, kv_cache_config=kv_config,
                     structured_output_manager=StructuredOutputManager(config), block_size=BS, log_stats=False)


@dataclass
class Transfers:
    """What the connector asked the stand-in worker for: in flight now, and counted so far."""

    in_flight: list[tuple[str, list[int]]] = field(default_factory=list)  # ("store"|"load", GPU block ids)
    stored_blocks: int = 0
    loaded_blocks: int = 0
    _pending: Any = None  # the previous step's metadata, reported done with this step's output

    def gpu_blocks_in_flight(self) -> set[int]:
        return {b for _, blocks in self.in_flight for b in blocks}


def plan(meta, transfers: Transfers) -> None:
    """Record what the step's connector metadata asks the worker to copy."""
    transfers.in_flight = [(t.kind, list(t.gpu_blocks)) for t in transfers_of(meta)]
    transfers.stored_blocks += sum(len(b) for kind, b in transfers.in_flight if kind == "store")
    transfers.loaded_blocks += sum(len(b) for kind, b in transfers.in_flight if kind == "load")
    transfers._pending = meta if transfers.in_flight else None


def completions(transfers: Transfers):
    """The KVConnectorOutput that reports the previous step's transfers done."""
    from vllm.v1.outputs import KVConnectorOutput

    meta, transfers._pending = transfers._pending, None
    if meta is None:
        return KVConnectorOutput()
    if is_simple(meta):
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        done = {meta.store_event: 1} if meta.store_gpu_blocks else {}
        loaded = {r for reqs in meta.load_event_to_reqs.values() for r in reqs} if meta.load_gpu_blocks else set()
        return KVConnectorOutput(finished_recving=loaded or None,
                                 kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=done))
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    jobs = transfers_of(meta)
    worker_meta = OffloadingWorkerMetadata(completed_jobs={t.job_id: 1 for t in jobs})
    loaded = {t.request for t in jobs if t.kind == "load"}
    return KVConnectorOutput(finished_recving=loaded or None, kv_connector_worker_meta=worker_meta)


def drive_with_connector(scheduler, waves: list[list], transfers: Transfers, after_step: Callable | None = None,
                         between_waves: Callable | None = None, max_steps: int = 3000) -> list:
    """Run every wave to completion (transfers drained too); each step's scheduled tokens per request."""
    trace: list = []
    for index, wave in enumerate(waves):
        if index and between_waves is not None:
            between_waves(scheduler)
        for request in wave:
            scheduler.add_request(request)
        while scheduler.has_requests() or transfers._pending is not None or _connector_busy(scheduler):
            assert len(trace) < max_steps, "the scheduler stopped making progress"
            out = scheduler.schedule()
            done = completions(transfers)
            plan(out.kv_connector_metadata, transfers)
            samplers = {r for r in out.num_scheduled_tokens
                        if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
            output = model_output(scheduler, out, samplers)
            output.kv_connector_output = done
            scheduler.update_from_output(out, output)
            trace.append(step_of(out))
            if after_step is not None:
                after_step(scheduler, transfers)
    return trace


def _connector_busy(scheduler) -> bool:
    side = getattr(scheduler.connector, "connector_scheduler", None)
    if side is not None:
        return bool(side._jobs)
    manager = scheduler.connector.scheduler_manager
    return manager.has_pending_stores() or bool(manager._reqs_to_load)
