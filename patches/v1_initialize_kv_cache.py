"""V1 runner: once vLLM has shaped the KV tensors, publish their layout to the scheduler."""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import ALL, before, since
from kvelastic.patches.engine_config import PARALLEL_CONFIG, SCHEDULER_CONFIG, VLLM_CONFIG
from kvelastic.patches.kv_cache_objects import PUBLISHING, V1_RUNNER

BEFORE_PROFILING_FLAG = before("0.20")
WITH_PROFILING_FLAG = since("0.20")  # 0.20 also calls it with is_profiling=True while profiling

TARGET = Target(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="GPUModelRunner.initialize_kv_cache",
    kind="method",
    shapes=(Signature(BEFORE_PROFILING_FLAG, ("self", "kv_cache_config")),
                Signature(WITH_PROFILING_FLAG, ("self", "kv_cache_config", "is_profiling"))),
)


def apply(patcher: Any, runtime: Any) -> None:
    from kvelastic.integration.allocation import publish_after_initialize

    patcher.wrap(TARGET, functools.partial(publish_after_initialize, runtime))


PATCH = Patch("v1_initialize_kv_cache", "V1 runner: publish the KV block layout to the scheduler",
              ALL, (TARGET, V1_RUNNER, *PUBLISHING, VLLM_CONFIG, PARALLEL_CONFIG, SCHEDULER_CONFIG), apply)
