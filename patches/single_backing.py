"""vLLM 0.29+: the one KV backing each runner allocates, served by the page pool and published.

From 0.29 ``vllm/v1/worker/utils.py:allocate_kv_cache`` makes every layer's KV
cache in one ``torch.zeros`` backing and cuts vLLM's per-layer views out of it.
Each runner's module imports it by name, so each runner gets a patch of its own
(``v1_single_backing``, ``v2_single_backing``, built here) that wraps that name
and the runner's ``initialize_kv_cache`` together: the backing comes from the
page pool (``kvelastic/worker/single_backing.py``) and, once vLLM has bound
its views, their layout is published in whole-page groups.

Declared here: vLLM's allocator itself, read (the wrapped names must be it).
Its body calls ``torch`` once, ``torch.zeros(size, dtype=torch.int8,
device=...)``, in every band-C release: the version matrix checks that in each
release's source (``kvelastic_dev.static_check.torch_calls``) and the stand-in
``torch`` refuses anything else at run time. No version difference is handled
here: the allocator's parameters are the same in 0.29-0.33.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import BAND_C
from kvelastic.patches import kv_connector_pool
from kvelastic.patches.engine_config import MODEL_CONFIG, PARALLEL_CONFIG, SCHEDULER_CONFIG, VLLM_CONFIG
from kvelastic.patches.kv_cache_objects import ALLOCATION, PUBLISHING, host_resident_test

ALLOCATE_PARAMS = ("kv_cache_config", "device", "layout", "kernel_block_sizes")
ALLOCATOR = Target(
    module="vllm.v1.worker.utils",
    qualname="allocate_kv_cache",
    kind="function",
    use="read",
    shapes=(Signature(BAND_C, ALLOCATE_PARAMS),),
)


def allocator_name(module: str) -> Target:
    """``allocate_kv_cache`` as imported by name into ``module``: the name a runner calls, wrapped there."""
    return Target(module=module, qualname="allocate_kv_cache", kind="function",
                  shapes=(Signature(BAND_C, ALLOCATE_PARAMS),))


def _allocate(runtime: Any, is_host_resident: Callable[[Any], bool], wrapped: Any, instance: Any, args: tuple,
              kwargs: dict) -> dict[str, Any]:
    from kvelastic.worker.single_backing import allocate_in_pool

    return allocate_in_pool(runtime, wrapped, args, kwargs, is_host_resident=is_host_resident)


def _initialize(runtime: Any, connector_has_pool: Callable[[], bool], wrapped: Any, instance: Any, args: tuple,
                kwargs: dict) -> Any:
    from kvelastic.worker.single_backing import publish_one_backing

    return publish_one_backing(runtime, wrapped, instance, args, kwargs, connector_has_pool=connector_has_pool)


def _apply(allocate: Target, initialize: Target, patcher: Any, runtime: Any) -> None:
    patcher.wrap(allocate, functools.partial(_allocate, runtime, host_resident_test(patcher)))
    patcher.wrap(initialize, functools.partial(_initialize, runtime, kv_connector_pool.connector_pool_test(patcher)))


def single_backing_patch(name: str, runner: str, allocate: Target, initialize: Target, runner_class: Target) -> Patch:
    """The band-C patch of one runner: its ``allocate_kv_cache`` name and its ``initialize_kv_cache``."""
    return Patch(name, f"{runner} runner: the one KV backing over CUDA virtual memory, vLLM's own views, "
                       "published in whole-page groups", BAND_C,
                 (allocate, initialize, ALLOCATOR, runner_class, *dict.fromkeys((*ALLOCATION, *PUBLISHING)),
                  VLLM_CONFIG, MODEL_CONFIG, PARALLEL_CONFIG, SCHEDULER_CONFIG, *kv_connector_pool.TARGETS),
                 functools.partial(_apply, allocate, initialize))
