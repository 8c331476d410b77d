"""Read one scheduling step's offload-connector metadata: which GPU blocks it stores and loads.

Used by the CPU tests' stand-in worker and by the GPU script that counts a
connector's own transfers. It reads vLLM's metadata objects as the releases in
CI (0.23, 0.28, 0.33) and on the GPU machine (0.25) shape them:
SimpleCPUOffloadConnector's ``store_gpu_blocks`` / ``load_gpu_blocks``, and
OffloadingConnector's ``store_jobs`` / ``load_jobs`` (a job's specs are one
``transfer_spec`` pair up to 0.23, ``src_spec`` and ``dst_spec`` from 0.24).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Transfer:
    kind: str  # "store" or "load"
    gpu_blocks: tuple[int, ...]
    job_id: int | None = None  # OffloadingConnector's job
    request: str | None = None


def is_simple(meta: Any) -> bool:
    return hasattr(meta, "store_gpu_blocks")


def transfers_of(meta: Any) -> list[Transfer]:
    """The transfers one step's connector metadata asks the workers for."""
    if meta is None:
        return []
    if is_simple(meta):
        return [Transfer(kind, tuple(blocks)) for kind, blocks in (("store", meta.store_gpu_blocks),
                                                                   ("load", meta.load_gpu_blocks)) if blocks]
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    found = []
    for kind, table in (("load", meta.load_jobs), ("store", meta.store_jobs)):
        for job_id, job in table.items():
            specs = getattr(job, "transfer_spec", None) or (job.src_spec, job.dst_spec)
            gpu = next(s for s in specs if isinstance(s, GPULoadStoreSpec))
            found.append(Transfer(kind, tuple(int(b) for b in gpu.block_ids), job_id, job.req_id))
    return found
