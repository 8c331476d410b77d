"""The version-gated vLLM patches, one module per patch point.

Each module defines ``PATCH`` (a :class:`kvelastic.patching.spec.Patch`): the
releases it claims, the targets it expects, and how it applies itself. Nothing
here imports vLLM; the gate does that when it checks the targets.
"""

from __future__ import annotations

from kvelastic.patching.spec import Patch
from kvelastic.patches import (
    admission_check,
    scheduler_block_pool,
    uniform_kv_cache,
    v1_allocate_kv_cache,
    v1_initialize_kv_cache,
    v2_allocate_kv_cache,
    v2_initialize_kv_cache,
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
    scheduler_block_pool.PATCH,
    admission_check.PATCH,
)
