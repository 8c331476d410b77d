"""vLLM 0.29+, engine core: layer-outermost KV layers start on whole pool pages.

``get_kv_cache_configs`` is imported by name into ``vllm.v1.engine.core``
(from ``kv_cache_utils`` up to 0.32, ``kv_cache_planning`` in 0.33), which is
where the engine core calls it; ``kvelastic/integration/whole_page_blocks.py``
rounds ``num_blocks`` through vLLM's ``num_gpu_blocks_override``.
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.integration.whole_page_blocks import plan_whole_pages
from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._band_c import BAND_C, BEFORE_0_33, FROM_0_33
from kvelastic.patches._common import argument

_PLAN = ("vllm_config", "kv_cache_specs", "available_memory")

TARGET = Target(
    module="vllm.v1.engine.core",
    qualname="get_kv_cache_configs",
    kind="function",
    signatures=(Signature(BEFORE_0_33, _PLAN), Signature(FROM_0_33, (*_PLAN, "global_kv_cache_groups"))),
)


def _plan(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> list[Any]:
    return plan_whole_pages(runtime, lambda: wrapped(*args, **kwargs), argument(wrapped, args, kwargs, "vllm_config"))


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, functools.partial(_plan, runtime))


PATCH = Patch("whole_page_num_blocks", "Engine core: num_blocks rounded so layer-outermost layers start on "
              "whole pages", BAND_C, (TARGET,), apply)
