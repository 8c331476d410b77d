"""vLLM 0.29+: the one KV backing each runner allocates, served by the page pool and published.

From 0.29 ``vllm/v1/worker/utils.py:allocate_kv_cache`` makes every layer's KV
cache in one ``torch.zeros`` backing and cuts vLLM's per-layer views out of it.
Each runner's module imports it by name, so each runner gets a patch of its own
(``v1_single_backing``, ``v2_single_backing``, built here) that wraps that name
and the runner's ``initialize_kv_cache`` together: the backing comes from the
page pool (``kvelastic/worker/single_backing.py``) and, once vLLM has bound
its views, their layout is published in whole-page groups.

Declared here: vLLM's allocator itself, read (the wrapped names must be it).
In band C (0.29-0.33) its body calls ``torch`` once, ``torch.zeros(size,
dtype=torch.int8, device=...)``: the version matrix checks that in each
release's source (``kvelastic_dev.static_check.torch_calls``) and the stand-in
``torch`` refuses anything else at run time. From 0.34 (band D) it takes an
``allocate(size)`` hook that replaces that backing (vLLM's extensible KV cache
passes one), so kvelastic passes its own and runs vLLM's function unchanged
(:func:`takes_allocate_hook`); the matrix checks that the hook is all the body
calls for the backing. The V1 runner is gone in 0.34: ``v1_single_backing``
claims band C only.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from kvelastic.patching.spec import Absent, Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import BAND_C, BAND_D, FROM_BAND_C
from kvelastic.patches import kv_connector_access, kv_connector_pool
from kvelastic.patches.engine_config import MODEL_CONFIG, PARALLEL_CONFIG, SCHEDULER_CONFIG, VLLM_CONFIG
from kvelastic.patches.kv_cache_objects import ALLOCATION, PUBLISHING, host_resident_test

ALLOCATE_PARAMS = ("kv_cache_config", "device", "layout", "kernel_block_sizes")
#: 0.34+: ``allocate(size) -> tensor`` replaces the ``torch.zeros`` backing (vLLM's extensible cache uses it).
ALLOCATE_HOOK = "allocate"
ALLOCATOR_SHAPES = (Signature(BAND_C, ALLOCATE_PARAMS), Signature(BAND_D, (*ALLOCATE_PARAMS, ALLOCATE_HOOK)))
ALLOCATOR = Target(
    module="vllm.v1.worker.utils",
    qualname="allocate_kv_cache",
    kind="function",
    use="read",
    shapes=ALLOCATOR_SHAPES,
)


def allocator_name(module: str, gone_from_band_d: bool = False) -> Target:
    """``allocate_kv_cache`` as imported by name into ``module``: the name a runner calls, wrapped there
    (``gone_from_band_d``: the module is deleted in band D, as the V1 runner's is)."""
    shapes = (ALLOCATOR_SHAPES[0], Absent(BAND_D)) if gone_from_band_d else ALLOCATOR_SHAPES
    return Target(module=module, qualname="allocate_kv_cache", kind="function", shapes=shapes)


def takes_allocate_hook(patcher: Any) -> bool:
    """Whether vLLM's allocator takes the backing from an ``allocate`` hook (0.34+) rather than ``torch.zeros``."""
    return ALLOCATE_HOOK in patcher.params(ALLOCATOR)


def _allocate(runtime: Any, is_host_resident: Callable[[Any], bool], hook: bool, wrapped: Any, instance: Any,
              args: tuple, kwargs: dict) -> dict[str, Any]:
    from kvelastic.worker.single_backing import allocate_in_pool

    return allocate_in_pool(runtime, wrapped, args, kwargs, is_host_resident=is_host_resident, hook=hook)


def _initialize(runtime: Any, connector_has_pool: Callable[[], bool], outside_access: Callable[[Any], str | None],
                wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from kvelastic.worker.single_backing import publish_one_backing

    return publish_one_backing(runtime, wrapped, instance, args, kwargs, connector_has_pool=connector_has_pool,
                               outside_access=outside_access)


def _apply(allocate: Target, initialize: Target, patcher: Any, runtime: Any) -> None:
    patcher.wrap(allocate, functools.partial(_allocate, runtime, host_resident_test(patcher),
                                             takes_allocate_hook(patcher)))
    patcher.wrap(initialize, functools.partial(_initialize, runtime, kv_connector_pool.connector_pool_test(patcher),
                                               kv_connector_access.outside_access_test(patcher)))


def single_backing_patch(name: str, runner: str, allocate: Target, initialize: Target, runner_class: Target,
                         versions: VersionRange = FROM_BAND_C) -> Patch:
    """The one-backing patch of one runner (``versions``: the releases that have it, in bands C and D): its
    ``allocate_kv_cache`` name and its ``initialize_kv_cache``."""
    return Patch(name, f"{runner} runner: the one KV backing over CUDA virtual memory, vLLM's own views, "
                       "published in whole-page groups", versions,
                 (allocate, initialize, ALLOCATOR, runner_class, *dict.fromkeys((*ALLOCATION, *PUBLISHING)),
                  VLLM_CONFIG, MODEL_CONFIG, PARALLEL_CONFIG, SCHEDULER_CONFIG, *kv_connector_pool.TARGETS,
                  *kv_connector_access.TARGETS),
                 functools.partial(_apply, allocate, initialize))
