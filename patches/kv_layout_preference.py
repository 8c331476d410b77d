"""vLLM 0.29+, worker: report block-outermost KV layouts first where no kernel block split follows.

The engine core resolves one layout from what the workers report; a user's or a
connector's choice still wins. See ``kvelastic/worker/layout_preference.py``
for when the order changes and why no token moves.

Declared here: the method wrapped, and what the preference reads to decide: the
worker's KV specs and attention backends, vLLM's own ``select_common_block_size``,
the attention spec classes and the layout enum.

Version difference handled here: ``select_common_block_size`` takes the layers'
``kv_cache_specs`` from 0.32 (:func:`common_block_size`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from kvelastic.patching.spec import Attributes, Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import FROM_BAND_C, since
from kvelastic.patches.kv_cache_objects import KV_CACHE_SPEC

if TYPE_CHECKING:
    from kvelastic.patching.apply import Patcher

_WORKER_BASE = "vllm.v1.worker.worker_base"
_INTERFACE = "vllm.v1.kv_cache_interface"

TARGET = Target(
    module=_WORKER_BASE,
    qualname="WorkerBase.get_supported_kv_cache_layouts",
    kind="method",
    shapes=(Signature(FROM_BAND_C, ("self",)),),
)
WORKER = Target(
    module=_WORKER_BASE,
    qualname="WorkerBase",
    kind="class",
    use="read",
    shapes=(Attributes(FROM_BAND_C, ("vllm_config",)),),
)
KV_CACHE_SPECS = Target(  # the GPU worker's own asks its runner; the base raises NotImplementedError
    module=_WORKER_BASE,
    qualname="WorkerBase.get_kv_cache_spec",
    kind="method",
    use="read",
    shapes=(Signature(FROM_BAND_C, ("self",)),),
)
ATTENTION_BACKENDS = Target(  # imported into worker_base from the KV connector utilities
    module=_WORKER_BASE,
    qualname="get_current_attn_backends",
    kind="function",
    use="read",
    shapes=(Signature(FROM_BAND_C, ("vllm_config", "layer_names")),),
)
_SELECT = ("kv_manager_block_size", "backends")
SELECT_COMMON_BLOCK_SIZE = Target(
    module="vllm.v1.worker.utils",
    qualname="select_common_block_size",
    kind="function",
    use="read",
    shapes=(Signature(VersionRange.of("0.29", "0.32"), _SELECT),
            Signature(since("0.32"), (*_SELECT, "kv_cache_specs"))),
)
ATTENTION_SPEC = Target(module=_INTERFACE, qualname="AttentionSpec", kind="class", use="read",
                        shapes=(Attributes(FROM_BAND_C, ()),))
MLA_ATTENTION_SPEC = Target(module=_INTERFACE, qualname="MLAAttentionSpec", kind="class", use="read",
                            shapes=(Attributes(FROM_BAND_C, ()),))
KV_CACHE_LAYOUT = Target(
    module="vllm.v1.kv_cache_layout",
    qualname="KVCacheLayout",
    kind="class",
    use="read",
    shapes=(Attributes(FROM_BAND_C, ("is_block_outermost",)),),
)

TARGETS = (TARGET, WORKER, KV_CACHE_SPECS, ATTENTION_BACKENDS, SELECT_COMMON_BLOCK_SIZE, KV_CACHE_SPEC,
           ATTENTION_SPEC, MLA_ATTENTION_SPEC, KV_CACHE_LAYOUT)


def common_block_size(patcher: Patcher) -> Callable[[int, list[Any], Any], int]:
    """``select(block_size, backends, spec)``: vLLM's common kernel block size for one spec's layers."""
    if "kv_cache_specs" in patcher.params(SELECT_COMMON_BLOCK_SIZE):
        return _select_per_spec
    return _select_for_backends


def _select_per_spec(block_size: int, backends: list[Any], spec: Any) -> int:
    from vllm.v1.worker.utils import select_common_block_size

    return select_common_block_size(block_size, backends, [spec] * len(backends))


def _select_for_backends(block_size: int, backends: list[Any], spec: Any) -> int:
    from vllm.v1.worker.utils import select_common_block_size

    return select_common_block_size(block_size, backends)


def _layouts(select: Callable[[int, list[Any], Any], int], wrapped: Any, instance: Any, args: tuple,
             kwargs: dict) -> list[str]:
    from kvelastic.worker.layout_preference import preferred_layouts

    return preferred_layouts(instance, wrapped(*args, **kwargs), select)


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, functools.partial(_layouts, common_block_size(patcher)))


PATCH = Patch("kv_layout_preference", "Worker: block-outermost KV layouts first where kernel blocks are whole",
              FROM_BAND_C, TARGETS, apply)
