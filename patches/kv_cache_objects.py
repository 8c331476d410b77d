"""What the worker-side patches read off vLLM's objects: the KV cache config and the model runners.

Nothing here is wrapped. The allocation reads the ``KVCacheConfig`` it is
asked to allocate (its tensors, its groups and their block size); after
``initialize_kv_cache`` the publishing step reads the runner's reshaped
``kv_caches``, its batch size (for the warm-up blocks) and its parallel layout.

Version differences handled here: ``KVCacheTensor.block_stride`` exists from
0.24; tensors with a positive one share one packed backing
(:func:`packs_tensors`). From 0.29 a ``KVCacheTensor`` places its layers in the
one backing (``layers``, ``layer_stride``, ``offset``; no ``shared_by``), and from
0.30 it may be ``host_resident`` (HiSparse's host pool; :func:`host_resident_test`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from kvelastic.patching.spec import Absent, Attributes, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import ALL, BAND_D, before, since

if TYPE_CHECKING:
    from kvelastic.patching.apply import Patcher

_INTERFACE = "vllm.v1.kv_cache_interface"
_PLACED = ("size", "layers", "layer_stride", "block_stride", "offset")  # one backing: where each layer lies
KV_CACHE_CONFIG = Target(
    module=_INTERFACE,
    qualname="KVCacheConfig",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("num_blocks", "kv_cache_tensors", "kv_cache_groups")),),
)
KV_CACHE_TENSOR = Target(
    module=_INTERFACE,
    qualname="KVCacheTensor",
    kind="class",
    use="read",
    shapes=(Attributes(before("0.24"), ("size", "shared_by")),
            Attributes(VersionRange.of("0.24", "0.29"), ("size", "shared_by", "block_stride")),
            Attributes(VersionRange.of("0.29", "0.30"), _PLACED),
            Attributes(since("0.30"), (*_PLACED, "host_resident"))),
)
KV_CACHE_GROUP = Target(
    module=_INTERFACE,
    qualname="KVCacheGroupSpec",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("layer_names", "kv_cache_spec")),),
)
KV_CACHE_SPEC = Target(  # the base of every spec: tokens per block, bytes per block of a layer
    module=_INTERFACE,
    qualname="KVCacheSpec",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("block_size", "page_size_bytes")),),
)
V1_RUNNER = Target(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="GPUModelRunner",
    kind="class",
    use="read",
    shapes=(Attributes(before("0.34"), ("vllm_config", "scheduler_config", "kv_caches", "runner_only_attn_layers")),
            Absent(BAND_D)),  # vLLM 0.34 deleted the V1 runner
)
V2_RUNNER = Target(  # binds kv_caches in initialize_kv_cache, which kvelastic wraps and reads it after
    module="vllm.v1.worker.gpu.model_runner",
    qualname="GPUModelRunner",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("vllm_config", "scheduler_config", "kv_caches"),
                       set_in=("__init__", "initialize_kv_cache")),),
)

ALLOCATION = (KV_CACHE_CONFIG, KV_CACHE_TENSOR, KV_CACHE_GROUP)
PUBLISHING = (KV_CACHE_CONFIG, KV_CACHE_GROUP, KV_CACHE_SPEC)


def packs_tensors(patcher: Patcher) -> bool:
    """Whether KV tensors may share one packed backing (``block_stride > 0``) in the patched release."""
    return patcher.declares(KV_CACHE_TENSOR) and "block_stride" in patcher.attributes(KV_CACHE_TENSOR)


def host_resident_test(patcher: Patcher) -> Callable[[Any], bool]:
    """How to tell a ``KVCacheTensor`` kept in host memory (HiSparse, 0.30+) in the patched release."""
    if "host_resident" in patcher.attributes(KV_CACHE_TENSOR):
        return _host_resident
    return _never_host_resident


def _host_resident(tensor: Any) -> bool:
    return bool(tensor.host_resident)


def _never_host_resident(tensor: Any) -> bool:
    return False
