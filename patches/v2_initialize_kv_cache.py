"""V2 runner: once vLLM has shaped the KV tensors, publish their layout to the scheduler."""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import ALL
from kvelastic.patches.engine_config import PARALLEL_CONFIG, SCHEDULER_CONFIG, VLLM_CONFIG
from kvelastic.patches.kv_cache_objects import PUBLISHING, V2_RUNNER

TARGET = Target(
    module="vllm.v1.worker.gpu.model_runner",
    qualname="GPUModelRunner.initialize_kv_cache",
    kind="method",
    shapes=(Signature(ALL, ("self", "kv_cache_config")),),
)


def apply(patcher: Any, runtime: Any) -> None:
    from kvelastic.integration.allocation import publish_after_initialize

    patcher.wrap(TARGET, functools.partial(publish_after_initialize, runtime))


PATCH = Patch("v2_initialize_kv_cache", "V2 runner: publish the KV block layout to the scheduler",
              ALL, (TARGET, V2_RUNNER, *PUBLISHING, VLLM_CONFIG, PARALLEL_CONFIG, SCHEDULER_CONFIG), apply)
