"""Worker: the KV cache's size is its virtual capacity; what vLLM profiled becomes the physical limit."""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import ALL

TARGET = Target(
    module="vllm.v1.worker.gpu_worker",
    qualname="Worker.determine_available_memory",
    kind="method",
    shapes=(Signature(ALL, ("self",)),),
)


def _determine(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> int:
    import torch

    profiled = int(wrapped(*args, **kwargs))
    total = torch.cuda.mem_get_info()[1]
    return runtime.plan_capacity(profiled_bytes=profiled, device_total_bytes=total).virtual_bytes


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, functools.partial(_determine, runtime))


PATCH = Patch("worker_capacity", "Worker: virtual KV capacity, profiled bytes become the physical limit",
              ALL, (TARGET,), apply)
