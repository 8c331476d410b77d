"""The version-gated vLLM patches, one module per patch point.

Each patch module defines ``PATCH`` (a :class:`kvelastic.patching.spec.Patch`):
the releases it claims, every vLLM contact it has (its targets) and how it
applies itself. Contacts of the scheduler side that are wrapped or read on
live objects are declared in modules of their own (``block_pool_queue``,
``host_tier_lookup``, ``engine_config``) and listed among the targets of the
patch that attaches them (``scheduler_block_pool``). The worker side of vLLM
0.12-0.28 (per-layer KV tensors) and of 0.29+ (one backing: ``single_backing``
builds ``v1_single_backing`` and ``v2_single_backing``) are separate patches
over the same runner methods. A version difference is
handled in the module that declares its contact, and nowhere else.

Importing this package imports no vLLM and none of kvelastic's integration:
patch modules pull in what they hook only when applied, so the integration
may import these declarations without an import cycle.
"""

from __future__ import annotations

from kvelastic.patching.spec import Patch
from kvelastic.patches import (
    admission_check,
    engine_core_wake,
    executor_handover,
    executor_step_report,
    extensible_kv_cache,
    hisparse_refusal,
    kv_layout_preference,
    scheduler_block_pool,
    sleep_mode,
    uniform_kv_cache,
    v1_allocate_kv_cache,
    v1_initialize_kv_cache,
    v1_single_backing,
    v2_allocate_kv_cache,
    v2_initialize_kv_cache,
    v2_single_backing,
    vllm_logging,
    warmup_blocks,
    whole_page_num_blocks,
    worker_capacity,
    worker_execute_model,
)

ALL_PATCHES: tuple[Patch, ...] = (
    uniform_kv_cache.PATCH,
    v1_allocate_kv_cache.PATCH,
    v1_initialize_kv_cache.PATCH,
    v2_allocate_kv_cache.PATCH,
    v2_initialize_kv_cache.PATCH,
    worker_capacity.PATCH,
    worker_execute_model.PATCH,
    executor_step_report.PATCH,
    executor_handover.PATCH,
    engine_core_wake.PATCH,
    scheduler_block_pool.PATCH,
    admission_check.PATCH,
    v1_single_backing.PATCH,
    v2_single_backing.PATCH,
    hisparse_refusal.PATCH,
    kv_layout_preference.PATCH,
    whole_page_num_blocks.PATCH,
    sleep_mode.PATCH,
    vllm_logging.PATCH,
    extensible_kv_cache.PATCH,
    warmup_blocks.PATCH,
)
