"""vLLM 0.29+, both runners: the one KV backing of ``allocate_kv_cache`` comes from the page pool.

``allocate_kv_cache`` lives in ``vllm.v1.worker.utils`` and is imported by name
into each runner's module, so each bound name is wrapped. vLLM's own function
still runs and still builds the views (``kvelastic/integration/single_backing.py``).
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.integration.single_backing import allocate_in_pool
from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._band_c import BAND_C

ALLOCATE_PARAMS = ("kv_cache_config", "device", "layout", "kernel_block_sizes")

V1_TARGET = Target(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="allocate_kv_cache",
    kind="function",
    signatures=(Signature(BAND_C, ALLOCATE_PARAMS),),
)
V2_TARGET = Target(
    module="vllm.v1.worker.gpu.attn_utils",
    qualname="allocate_kv_cache",
    kind="function",
    signatures=(Signature(BAND_C, ALLOCATE_PARAMS),),
)


def _allocate(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    return allocate_in_pool(runtime, wrapped, *args, **kwargs)


def apply(patcher: Any, runtime: Any) -> None:
    for target in (V1_TARGET, V2_TARGET):
        patcher.wrap(target, functools.partial(_allocate, runtime))


PATCH = Patch("single_backing_allocation", "Both runners: the one KV backing over CUDA virtual memory, "
              "vLLM's own views", BAND_C, (V1_TARGET, V2_TARGET), apply)
