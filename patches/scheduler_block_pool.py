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
EVICT_CACHED = Target(  # read, not wrapped: the page-aware queue evicts cached blocks through it
    module="vllm.v1.core.block_pool",
    qualname="BlockPool._maybe_evict_cached_block",
    kind="method",
    signatures=(Signature(ALL, ("self", "block")),),
)


def _init(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    wrapped(*args, **kwargs)
    attach_scheduler(instance, runtime)


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(SCHEDULER_INIT, functools.partial(_init, runtime))


PATCH = Patch("scheduler_block_pool", "Scheduler: page-aware GPU block pool, reclaimer thread",
              ALL, (SCHEDULER_INIT, EVICT_CACHED), apply)
