"""V2 runner, vLLM 0.29+: the one KV backing from the page pool, published in whole-page groups.

``vllm.v1.worker.gpu.attn_utils`` imports ``allocate_kv_cache`` by name (its
``init_kv_cache`` calls it inside the runner's allocation context); the runner's
``initialize_kv_cache`` lives in ``vllm.v1.worker.gpu.model_runner``, which
imports ``attn_utils``, so the patch applies once the runner module is imported.
See ``patches/single_backing.py``.
"""

from __future__ import annotations

from kvelastic.patches import v2_initialize_kv_cache
from kvelastic.patches.kv_cache_objects import V2_RUNNER
from kvelastic.patches.single_backing import allocator_name, single_backing_patch

ALLOCATE = allocator_name("vllm.v1.worker.gpu.attn_utils")

PATCH = single_backing_patch("v2_single_backing", "V2", ALLOCATE, v2_initialize_kv_cache.TARGET, V2_RUNNER)
