"""V2 runner: once vLLM has shaped the KV tensors, publish their layout to the scheduler (up to 0.28).

The target is declared for every release: from 0.29 ``v2_single_backing`` wraps
it (with ``is_profiling`` and the sleep-mode ``kv_cache_allocation_context``).
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import BAND_C, BAND_D, BEFORE_BAND_C
from kvelastic.patches import kv_connector_access
from kvelastic.patches.engine_config import PARALLEL_CONFIG, SCHEDULER_CONFIG, VLLM_CONFIG
from kvelastic.patches.kv_cache_objects import PUBLISHING, V2_RUNNER

TARGET = Target(
    module="vllm.v1.worker.gpu.model_runner",
    qualname="GPUModelRunner.initialize_kv_cache",
    kind="method",
    shapes=(Signature(BEFORE_BAND_C, ("self", "kv_cache_config")),
            Signature(BAND_C, ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context")),
            Signature(BAND_D, ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context",
                               "extensible"))),  # extensible: vLLM's own VMM cache, which kvelastic turns off
)


def apply(patcher: Any, runtime: Any) -> None:
    from kvelastic.worker.allocation import publish_after_initialize

    patcher.wrap(TARGET, functools.partial(publish_after_initialize, runtime,
                                           outside_access=kv_connector_access.outside_access_test(patcher)))


PATCH = Patch("v2_initialize_kv_cache", "V2 runner: publish the KV block layout to the scheduler",
              BEFORE_BAND_C, (TARGET, V2_RUNNER, *PUBLISHING, VLLM_CONFIG, PARALLEL_CONFIG, SCHEDULER_CONFIG,
               *kv_connector_access.TARGETS), apply)
