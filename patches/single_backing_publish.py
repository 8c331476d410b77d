"""vLLM 0.29+, both runners: publish the views of the one backing, in groups of whole pages.

Once ``initialize_kv_cache`` has built vLLM's views over the pool's backing,
their block layout is read off them and published to the scheduler, as in the
older bands; the group size is chosen so a group covers whole pool pages where
that stays small (``kvelastic/integration/page_alignment.py``). From 0.29 both
runners take ``is_profiling`` and the sleep-mode ``kv_cache_allocation_context``.
Sleep mode itself is refused here (``kvelastic/integration/sleep_mode.py``).
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.integration.allocation import publish_after_initialize
from kvelastic.integration.page_alignment import group_blocks_of_config
from kvelastic.integration.single_backing import VIEW_BLOCK_DIM
from kvelastic.integration.sleep_mode import refuse_sleep_mode
from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._band_c import BAND_C

INITIALIZE_PARAMS = ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context")

V1_TARGET = Target(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="GPUModelRunner.initialize_kv_cache",
    kind="method",
    signatures=(Signature(BAND_C, INITIALIZE_PARAMS),),
)
V2_TARGET = Target(
    module="vllm.v1.worker.gpu.model_runner",
    qualname="GPUModelRunner.initialize_kv_cache",
    kind="method",
    signatures=(Signature(BAND_C, INITIALIZE_PARAMS),),
)


def _initialize(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    refuse_sleep_mode(instance.vllm_config)
    return publish_after_initialize(runtime, wrapped, instance, args, kwargs, group_blocks=group_blocks_of_config,
                                    block_dim=VIEW_BLOCK_DIM)


def apply(patcher: Any, runtime: Any) -> None:
    for target in (V1_TARGET, V2_TARGET):
        patcher.wrap(target, functools.partial(_initialize, runtime))


PATCH = Patch("single_backing_publish", "Both runners: publish the one backing's block layout in whole-page "
              "groups", BAND_C, (V1_TARGET, V2_TARGET), apply)
