"""V1 runner: KV tensors come from the elastic page pool instead of ``torch.zeros`` (up to 0.28).

From 0.29 the method is gone; ``v1_single_backing`` serves vLLM's one backing instead.
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import BEFORE_BAND_C, argument
from kvelastic.patches.kv_cache_objects import ALLOCATION, V1_RUNNER, packs_tensors

TARGET = Target(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="GPUModelRunner._allocate_kv_cache_tensors",
    kind="method",
    shapes=(Signature(BEFORE_BAND_C, ("self", "kv_cache_config")),),
)


def _allocate(runtime: Any, packed: bool, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    from kvelastic.worker.allocation import allocate_kv_tensors

    config = argument(wrapped, args, kwargs, "kv_cache_config")
    raw = allocate_kv_tensors(runtime, config, packed=packed)
    skip = instance.runner_only_attn_layers
    expected = {name for group in config.kv_cache_groups for name in group.layer_names if name not in skip}
    if expected != set(raw):
        raise AssertionError("kvelastic: some KV layers were not allocated")
    return raw


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, functools.partial(_allocate, runtime, packs_tensors(patcher)))


PATCH = Patch("v1_allocate_kv_cache", "V1 runner: KV tensors over CUDA virtual memory", BEFORE_BAND_C,
              (TARGET, *ALLOCATION, V1_RUNNER), apply)
