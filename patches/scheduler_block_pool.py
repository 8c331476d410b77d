"""Scheduler: make the GPU block pool page-aware and start the reclaimer."""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.integration.scheduler import attach_scheduler
from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import ALL

BEFORE_HASH_BLOCK_SIZE = VersionRange.of("0.12", "0.20")
WITH_HASH_BLOCK_SIZE = VersionRange.of("0.20", "0.29")

SCHEDULER_INIT = Target(
    module="vllm.v1.core.sched.scheduler",
    qualname="Scheduler.__init__",
    kind="method",
    signatures=(Signature(BEFORE_HASH_BLOCK_SIZE, ("self", "vllm_config", "kv_cache_config",
                                                   "structured_output_manager", "block_size", "mm_registry",
                                                   "include_finished_set", "log_stats")),
                Signature(WITH_HASH_BLOCK_SIZE, ("self", "vllm_config", "kv_cache_config",
                                                 "structured_output_manager", "block_size", "hash_block_size",
                                                 "mm_registry", "include_finished_set", "log_stats"))),
)
_ESTIMATE = ("self", "request_id", "num_tokens", "new_computed_blocks", "num_encoder_tokens")
BLOCKS_TO_ALLOCATE = Target(  # wrapped on the scheduler's coordinator instance (integration/commit_guard.py)
    module="vllm.v1.core.kv_cache_coordinator",
    qualname="KVCacheCoordinator.get_num_blocks_to_allocate",
    kind="method",
    wrapped=False,
    signatures=(Signature(VersionRange.of("0.12", "0.14"), _ESTIMATE),
                Signature(VersionRange.of("0.14", "0.15"), (*_ESTIMATE, "total_computed_tokens")),
                Signature(VersionRange.of("0.15", "0.20.2"), (*_ESTIMATE, "total_computed_tokens",
                                                               "num_tokens_main_model")),
                Signature(VersionRange.of("0.20.2", "0.26"), (*_ESTIMATE, "total_computed_tokens",
                                                              "num_tokens_main_model", "apply_admission_cap")),
                Signature(VersionRange.of("0.26", "0.29"), (*_ESTIMATE, "total_computed_tokens",
                                                            "num_local_computed_tokens", "num_tokens_main_model",
                                                            "apply_admission_cap"))),
)
EVICT_CACHED = Target(  # read, not wrapped: the page-aware queue evicts cached blocks through it
    module="vllm.v1.core.block_pool",
    qualname="BlockPool._maybe_evict_cached_block",
    kind="method",
    wrapped=False,
    signatures=(Signature(ALL, ("self", "block")),),
)


def _init(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    wrapped(*args, **kwargs)
    attach_scheduler(instance, runtime)


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(SCHEDULER_INIT, functools.partial(_init, runtime))


PATCH = Patch("scheduler_block_pool", "Scheduler: page-aware GPU block pool, reclaimer thread",
              ALL, (SCHEDULER_INIT, BLOCKS_TO_ALLOCATE, EVICT_CACHED), apply)
