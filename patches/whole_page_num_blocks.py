"""vLLM 0.29+, engine core: layer-outermost KV layers start on whole pool pages.

``get_kv_cache_configs`` is imported by name into ``vllm.v1.engine.core``
(from ``kv_cache_utils`` up to 0.32, ``kv_cache_planning`` in 0.33), which is
where the engine core calls it; ``kvelastic/worker/whole_page_blocks.py``
rounds ``num_blocks`` through vLLM's ``CacheConfig.num_gpu_blocks_override``
(declared in ``engine_config``) and reads the ``KVCacheTensor`` placement
(``kv_cache_objects``).

Version difference handled here: ``get_kv_cache_configs`` takes
``global_kv_cache_groups`` from 0.33; the wrapper passes every argument through.
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import FROM_BAND_C, argument, since
from kvelastic.patches.engine_config import CACHE_CONFIG, VLLM_CONFIG
from kvelastic.patches.kv_cache_objects import KV_CACHE_CONFIG, KV_CACHE_TENSOR

_PLAN = ("vllm_config", "kv_cache_specs", "available_memory")

TARGET = Target(
    module="vllm.v1.engine.core",
    qualname="get_kv_cache_configs",
    kind="function",
    shapes=(Signature(VersionRange.of("0.29", "0.33"), _PLAN),
            Signature(since("0.33"), (*_PLAN, "global_kv_cache_groups"))),
)


def _plan(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> list[Any]:
    from kvelastic.worker.whole_page_blocks import plan_whole_pages

    return plan_whole_pages(runtime, lambda: wrapped(*args, **kwargs), argument(wrapped, args, kwargs, "vllm_config"))


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, functools.partial(_plan, runtime))


PATCH = Patch("whole_page_num_blocks", "Engine core: num_blocks rounded so layer-outermost layers start on "
              "whole pages", FROM_BAND_C, (TARGET, VLLM_CONFIG, CACHE_CONFIG, KV_CACHE_CONFIG, KV_CACHE_TENSOR), apply)
