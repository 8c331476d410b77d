"""V1 runner, vLLM 0.29+: the one KV backing from the page pool, published in whole-page groups.

``vllm.v1.worker.gpu_model_runner`` imports ``allocate_kv_cache`` by name and
calls it from ``initialize_kv_cache``; both live in that module, so the patch
applies when it is imported. Band C only: vLLM 0.34 deleted the module (band D
has the V2 runner alone). See ``patches/single_backing.py``.
"""

from __future__ import annotations

from kvelastic.patches import v1_initialize_kv_cache
from kvelastic.patches.kv_cache_objects import V1_RUNNER
from kvelastic.patches._common import BAND_C
from kvelastic.patches.single_backing import allocator_name, single_backing_patch

ALLOCATE = allocator_name("vllm.v1.worker.gpu_model_runner", gone_from_band_d=True)

PATCH = single_backing_patch("v1_single_backing", "V1", ALLOCATE, v1_initialize_kv_cache.TARGET, V1_RUNNER,
                             versions=BAND_C)  # vLLM 0.34 removed the V1 runner
