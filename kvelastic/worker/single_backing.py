"""vLLM 0.29+: the one KV backing of ``allocate_kv_cache`` comes from the page pool.

From 0.29 vLLM allocates every layer's KV cache at once: ``allocate_kv_cache``
(``vllm/v1/worker/utils.py``) calls ``torch.zeros(size, dtype=torch.int8)`` a
single time and cuts per-layer views out of that backing with
``create_kv_cache_views``. Which views, for which specs, with which kernel block
split, changes from release to release.

kvelastic does not rebuild any of that. It runs vLLM's own function, the same
code object, against a copy of its module's globals in which the one name
``torch`` is a stand-in: ``zeros`` reserves the bytes in the page pool (nothing
is mapped, fresh pages read as zeros once mapped) and every other attribute is
torch itself. The views handed back are therefore vLLM's own. If a release ever
allocates more than that one backing, or one of another dtype, the stand-in
refuses with :class:`~kvelastic.errors.LayoutError` rather than guess.

Layers whose spec has no per-layer views (HiSparse's raw tensors, 0.30+) get the
backing itself; kvelastic cannot tell which bytes their blocks use, so such a
model is refused here, before any page is mapped.

After a runner's ``initialize_kv_cache`` the views are published in whole-page
groups (:func:`publish_one_backing`). Refused before vLLM's method allocates
anything: sleep mode (``sleep_mode.py``) and a KV connector that allocates the
KV cache in a memory pool of its own (:func:`refuse_connector_pool`).
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable

from kvelastic.errors import LayoutError, PatchError
from kvelastic.startup.runtime import Runtime

#: ``create_kv_cache_views`` returns ``[B, H, N, C]`` per layer (B: kernel blocks), and both runners
#: keep those views in ``runner.kv_caches``: the block dimension is known, not guessed from lengths.
VIEW_BLOCK_DIM = 0
ALLOCATOR_MODULE = "vllm.v1.worker.utils"
ALLOCATOR_NAME = "allocate_kv_cache"


class PoolZeros:
    """The ``torch`` that vLLM's ``allocate_kv_cache`` sees: ``zeros`` comes from the pool."""

    def __init__(self, runtime: Runtime):
        import torch

        self._torch = torch
        self._runtime = runtime
        self.backing: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def zeros(self, size: int, *, dtype: Any, device: Any) -> Any:
        if self.backing is not None:
            raise LayoutError("vLLM's allocate_kv_cache asked for a second KV backing; kvelastic "
                              "serves exactly one (vLLM 0.29-0.33 allocate one)")
        if dtype is not self._torch.int8 or not isinstance(size, int):
            raise LayoutError(f"vLLM's allocate_kv_cache asked for a backing of {size!r} {dtype}; "
                              "kvelastic serves one flat int8 backing")
        backing = self._runtime.new_pool().add_tensor(size)
        if backing.device.type != self._torch.device(device).type:
            raise LayoutError(f"the page pool makes {backing.device.type} tensors but vLLM allocates "
                              f"its KV cache on {device}")
        self.backing = backing
        return backing


def with_torch(function: Callable[..., Any], stand_in: Any) -> Callable[..., Any]:
    """``function``'s own code, reading ``stand_in`` where its module says ``torch``."""
    scope = dict(function.__globals__)
    scope["torch"] = stand_in
    copy = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def check_allocator(function: Any) -> None:
    """``function`` must be vLLM's own ``allocate_kv_cache`` (``patches/single_backing.py:ALLOCATOR``)."""
    from vllm.v1.worker import utils

    if function is not utils.allocate_kv_cache or not isinstance(function, types.FunctionType):
        raise PatchError(f"kvelastic expected vLLM's {ALLOCATOR_MODULE}.{ALLOCATOR_NAME}, found {function!r}: "
                         "something else wraps or replaces vLLM's KV allocation")


def allocate_in_pool(runtime: Runtime, allocate: Callable[..., Any], args: tuple, kwargs: dict, *,
                     is_host_resident: Callable[[Any], bool]) -> dict[str, Any]:
    """Run vLLM's ``allocate_kv_cache(*args, **kwargs)`` with its backing reserved in a new page pool.

    ``is_host_resident`` tells a tensor kept in host memory (HiSparse, 0.30+), which the
    GPU allocation never gets from vLLM itself; one that does is refused.
    """
    check_allocator(allocate)
    kv_cache_config = inspect.signature(allocate).bind(*args, **kwargs).arguments["kv_cache_config"]
    resident = [t.layers for t in kv_cache_config.kv_cache_tensors if is_host_resident(t)]
    if resident:
        raise LayoutError(f"host-resident KV tensors (layers {resident[0][:3]}...) reached the GPU "
                          "allocation; kvelastic backs only device tensors")
    stand_in = PoolZeros(runtime)
    views: dict[str, Any] = with_torch(allocate, stand_in)(*args, **kwargs)
    if stand_in.backing is not None:
        refuse_raw_layers(views, stand_in.backing)
    return views


def refuse_raw_layers(views: dict[str, Any], backing: Any) -> None:
    """Layers handed the backing itself lay their blocks out on their own: kvelastic cannot map them."""
    raw = sorted(name for name, view in views.items() if view is backing)
    if raw:
        raise LayoutError(f"KV layers {raw[:3]}{'...' if len(raw) > 3 else ''} take vLLM's raw KV backing "
                          "(a spec without per-layer views, such as HiSparse's): kvelastic cannot tell "
                          "which bytes their blocks use. Run this model with KVELASTIC=0")


def refuse_connector_pool(connector_has_pool: bool) -> None:
    """A KV connector that allocates the KV cache in its own pool (0.31+) would never get kvelastic's pages."""
    if connector_has_pool:
        raise PatchError("kvelastic: this KV connector allocates the KV cache in a memory pool of its own "
                         "(get_mem_pool_context, such as Mooncake's), but kvelastic serves the KV cache from its "
                         "page pool, so the connector would not hold it. Run this connector with KVELASTIC=0")


def publish_one_backing(runtime: Runtime, initialize: Any, runner: Any, args: tuple, kwargs: dict, *,
                        connector_has_pool: Callable[[], bool]) -> Any:
    """A runner's ``initialize_kv_cache``: refusals first, then vLLM's, then its views published.

    Refused before anything is allocated: sleep mode, and a KV connector with a
    memory pool of its own (``connector_has_pool``, from
    ``patches/kv_connector_pool.py``). The group size is whole pages of the one
    backing where that stays small
    (:func:`~kvelastic.worker.page_alignment.group_blocks_of_config`), and the
    views' block dimension is known (:data:`VIEW_BLOCK_DIM`).
    """
    from kvelastic.worker.allocation import publish_after_initialize
    from kvelastic.worker.page_alignment import group_blocks_of_config
    from kvelastic.worker.sleep_mode import refuse_sleep_mode

    refuse_sleep_mode(runner.vllm_config.model_config.enable_sleep_mode)
    refuse_connector_pool(connector_has_pool())
    return publish_after_initialize(runtime, initialize, runner, args, kwargs, group_blocks=group_blocks_of_config,
                                    block_dim=VIEW_BLOCK_DIM)
