"""V1 runner: once vLLM has shaped the KV tensors, publish their layout to the scheduler."""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.integration.allocation import publish_views, startup_blocks
from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import ALL, argument

BEFORE_PROFILING_FLAG = VersionRange.of("0.12", "0.20")
WITH_PROFILING_FLAG = VersionRange.of("0.20", "0.29")  # 0.20 also calls it with is_profiling=True while profiling

TARGET = Target(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="GPUModelRunner.initialize_kv_cache",
    kind="method",
    signatures=(Signature(BEFORE_PROFILING_FLAG, ("self", "kv_cache_config")),
                Signature(WITH_PROFILING_FLAG, ("self", "kv_cache_config", "is_profiling"))),
)


def _initialize(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    pool = runtime.finish_allocation()
    if pool is not None:
        config = argument(wrapped, args, kwargs, "kv_cache_config")
        publish_views(runtime, pool, instance.kv_caches, config.num_blocks,
                      premap_blocks=startup_blocks(instance, config))
    return result


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, functools.partial(_initialize, runtime))


PATCH = Patch("v1_initialize_kv_cache", "V1 runner: publish the KV block layout to the scheduler",
              ALL, (TARGET,), apply)
