"""vLLM 0.29+: the one KV backing of ``allocate_kv_cache`` comes from the page pool.

From 0.29 vLLM allocates every layer's KV cache at once: ``allocate_kv_cache``
(``vllm/v1/worker/utils.py``) makes one int8 backing and cuts per-layer views
out of it with ``create_kv_cache_views``. Which views, for which specs, with
which kernel block split, changes from release to release, and kvelastic
rebuilds none of it: the views handed back are vLLM's own.

- From 0.34 (band D) the function takes an ``allocate(size)`` hook that makes
  the backing (vLLM's extensible cache passes its own). kvelastic passes one
  that reserves the bytes in a new page pool (:class:`PoolBacking`) and calls
  vLLM's function as it is. vLLM's extensible cache is off with kvelastic
  (``patches/extensible_kv_cache.py``), so a hook already passed means something
  else serves the backing: refused.
- In 0.29-0.33 (band C) the backing is one ``torch.zeros(size,
  dtype=torch.int8)``, with no hook. kvelastic runs vLLM's own function, the
  same code object, against a copy of its module's globals in which the one name
  ``torch`` is a stand-in (:class:`PoolZeros`): ``zeros`` reserves the bytes in
  the page pool and every other attribute is torch itself.

Either way nothing is mapped at first and fresh pages read as zeros once
mapped. A second backing, or one of another dtype, is refused with
:class:`~kvelastic.errors.LayoutError` rather than guessed at.

Layers whose spec has no per-layer views (HiSparse's raw tensors, 0.30+) get the
backing itself; kvelastic cannot tell which bytes their blocks use, so such a
model is refused here, before any page is mapped.

After a runner's ``initialize_kv_cache`` the views are published in whole-page
groups (:func:`publish_one_backing`). Refused before vLLM's method allocates
anything: sleep mode under worker ranks (``sleep_mode.py``) and the KV connectors the pool cannot
serve (``connector_access.py``).
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


class PoolBacking:
    """The ``allocate(size)`` hook of vLLM 0.34+'s ``allocate_kv_cache``: the one backing, from a new pool."""

    def __init__(self, runtime: Runtime, device: Any):
        self._runtime = runtime
        self._device = device
        self.backing: Any = None

    def __call__(self, size: int) -> Any:
        import torch

        if self.backing is not None:
            raise LayoutError("vLLM's allocate_kv_cache asked for a second KV backing; kvelastic serves exactly one")
        if not isinstance(size, int) or size <= 0:
            raise LayoutError(f"vLLM's allocate_kv_cache asked for a backing of {size!r} bytes")
        backing = self._runtime.new_pool().add_tensor(size)
        if backing.device.type != torch.device(self._device).type:
            raise LayoutError(f"the page pool makes {backing.device.type} tensors but vLLM allocates "
                              f"its KV cache on {self._device}")
        self.backing = backing
        return backing


class PoolZeros:
    """The ``torch`` that vLLM 0.29-0.33's ``allocate_kv_cache`` sees: ``zeros`` comes from the pool."""

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
                     is_host_resident: Callable[[Any], bool], hook: bool = False) -> dict[str, Any]:
    """Run vLLM's ``allocate_kv_cache(*args, **kwargs)`` with its backing reserved in a new page pool.

    ``is_host_resident`` tells a tensor kept in host memory (HiSparse, 0.30+), which the
    GPU allocation never gets from vLLM itself; one that does is refused. ``hook``: the
    release's allocator takes the backing from its ``allocate`` argument (0.34+,
    ``patches/single_backing.py:takes_allocate_hook``) rather than from ``torch.zeros``.
    """
    check_allocator(allocate)
    bound = inspect.signature(allocate).bind(*args, **kwargs)
    resident = [t.layers for t in bound.arguments["kv_cache_config"].kv_cache_tensors if is_host_resident(t)]
    if resident:
        raise LayoutError(f"host-resident KV tensors (layers {resident[0][:3]}...) reached the GPU "
                          "allocation; kvelastic backs only device tensors")
    if hook:
        stand_in: PoolBacking | PoolZeros = PoolBacking(runtime, bound.arguments["device"])
        refuse_other_hook(bound.arguments.get("allocate"))
        bound.arguments["allocate"] = stand_in
        views: dict[str, Any] = allocate(*bound.args, **bound.kwargs)
    else:
        stand_in = PoolZeros(runtime)
        views = with_torch(allocate, stand_in)(*args, **kwargs)
    if stand_in.backing is not None:
        refuse_raw_layers(views, stand_in.backing)
    return views


def refuse_other_hook(hook: Any) -> None:
    """A backing hook the caller passed itself: something other than kvelastic serves the KV cache."""
    if hook is not None:
        raise PatchError(f"kvelastic: vLLM's allocate_kv_cache was handed a backing of its own ({hook!r}): "
                         "vLLM's extensible KV cache (which kvelastic turns off) or something else serves the KV "
                         "cache here. Run with KVELASTIC=0 to keep it")


def refuse_raw_layers(views: dict[str, Any], backing: Any) -> None:
    """Layers handed the backing itself lay their blocks out on their own: kvelastic cannot map them."""
    raw = sorted(name for name, view in views.items() if view is backing)
    if raw:
        raise LayoutError(f"KV layers {raw[:3]}{'...' if len(raw) > 3 else ''} take vLLM's raw KV backing "
                          "(a spec without per-layer views, such as HiSparse's): kvelastic cannot tell "
                          "which bytes their blocks use. Run this model with KVELASTIC=0")


def publish_one_backing(runtime: Runtime, initialize: Any, runner: Any, args: tuple, kwargs: dict, *,
                        connector_has_pool: Callable[[], bool],
                        outside_access: Callable[[Any], str | None]) -> Any:
    """A runner's ``initialize_kv_cache``: refusals first, then vLLM's, then its views published.

    Refused before anything is allocated: sleep mode under worker ranks, a KV connector with a
    memory pool of its own (``connector_has_pool``, from
    ``patches/kv_connector_pool.py``) and one that reaches the KV cache from outside the
    process (``outside_access``, :mod:`kvelastic.worker.connector_access`). The group size is whole pages of the one
    backing where that stays small
    (:func:`~kvelastic.worker.page_alignment.group_blocks_of_config`), and the
    views' block dimension is known (:data:`VIEW_BLOCK_DIM`).
    """
    from kvelastic.worker.allocation import publish_after_initialize
    from kvelastic.worker.page_alignment import group_blocks_of_config
    from kvelastic.tp.worker_side import scheduler_elsewhere
    from kvelastic.worker.connector_access import refuse_connector_pool
    from kvelastic.worker.sleep_mode import refuse_sleep_mode

    refuse_sleep_mode(runner.vllm_config.model_config.enable_sleep_mode, scheduler_elsewhere(runner))
    refuse_connector_pool(connector_has_pool())
    return publish_after_initialize(runtime, initialize, runner, args, kwargs, outside_access=outside_access,
                                    group_blocks=group_blocks_of_config, block_dim=VIEW_BLOCK_DIM)
