"""V2 runner: KV tensors come from the elastic page pool instead of ``torch.zeros`` (up to 0.28).

From 0.29 the function is gone; ``v2_single_backing`` serves vLLM's one backing instead.
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import BEFORE_BAND_C, argument, before
from kvelastic.patches.kv_cache_objects import ALLOCATION, packs_tensors

BEFORE_SHARED_LAYERS = before("0.22")
WITH_SHARED_LAYERS = VersionRange.of("0.22", "0.29")

TARGET = Target(
    module="vllm.v1.worker.gpu.attn_utils",
    qualname="_allocate_kv_cache",
    kind="function",
    shapes=(Signature(BEFORE_SHARED_LAYERS, ("kv_cache_config", "device")),
                Signature(WITH_SHARED_LAYERS, ("kv_cache_config", "shared_layers", "device"))),
)


def _allocate(runtime: Any, packed: bool, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    from kvelastic.worker.allocation import allocate_kv_tensors

    return allocate_kv_tensors(runtime, argument(wrapped, args, kwargs, "kv_cache_config"), packed=packed)


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, functools.partial(_allocate, runtime, packs_tensors(patcher)))


PATCH = Patch("v2_allocate_kv_cache", "V2 runner: KV tensors over CUDA virtual memory", BEFORE_BAND_C,
              (TARGET, *ALLOCATION), apply)
