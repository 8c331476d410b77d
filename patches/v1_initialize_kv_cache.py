"""V1 runner: once vLLM has shaped the KV tensors, publish their layout to the scheduler (up to 0.28).

The target is declared for every release: from 0.29 ``v1_single_backing`` wraps
it (with the sleep-mode ``kv_cache_allocation_context`` its callers pass).
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Absent, Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import BAND_C, BAND_D, BEFORE_BAND_C, before
from kvelastic.patches import kv_connector_access
from kvelastic.patches.engine_config import PARALLEL_CONFIG, SCHEDULER_CONFIG, VLLM_CONFIG
from kvelastic.patches.kv_cache_objects import PUBLISHING, V1_RUNNER

BEFORE_PROFILING_FLAG = before("0.20")
WITH_PROFILING_FLAG = VersionRange.of("0.20", "0.29")  # 0.20 also calls it with is_profiling=True while profiling

TARGET = Target(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="GPUModelRunner.initialize_kv_cache",
    kind="method",
    shapes=(Signature(BEFORE_PROFILING_FLAG, ("self", "kv_cache_config")),
            Signature(WITH_PROFILING_FLAG, ("self", "kv_cache_config", "is_profiling")),
            Signature(BAND_C, ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context")),
            Absent(BAND_D)),  # vLLM 0.34 deleted the V1 runner
)


def apply(patcher: Any, runtime: Any) -> None:
    from kvelastic.worker.allocation import publish_after_initialize

    patcher.wrap(TARGET, functools.partial(publish_after_initialize, runtime,
                                           outside_access=kv_connector_access.outside_access_test(patcher)))


PATCH = Patch("v1_initialize_kv_cache", "V1 runner: publish the KV block layout to the scheduler",
              BEFORE_BAND_C, (TARGET, V1_RUNNER, *PUBLISHING, VLLM_CONFIG, PARALLEL_CONFIG, SCHEDULER_CONFIG,
               *kv_connector_access.TARGETS), apply)
