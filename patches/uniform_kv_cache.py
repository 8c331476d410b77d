"""V1 runner: never use one cross-layer KV buffer, so KV tensors stay per layer.

A connector that prefers cross-layer blocks (OffloadingConnector) makes
``use_uniform_kv_cache`` return True, and vLLM then allocates one buffer for
all layers outside ``_allocate_kv_cache_tensors``. Per-layer tensors are what
the page pool backs, and the connector works with them too. From 0.29 every
layer lives in one backing and this choice is gone (``v1_single_backing``).
"""

from __future__ import annotations

from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import BAND_A, BAND_B, BEFORE_BAND_C

TARGET = Target(
    module="vllm.v1.worker.kv_connector_model_runner_mixin",
    qualname="KVConnectorModelRunnerMixin.use_uniform_kv_cache",
    kind="staticmethod",
    shapes=(Signature(BAND_A, ("attn_groups", "cache_dtype")), Signature(BAND_B, ("attn_groups",))),
)


def _never_uniform(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> bool:
    return False


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, _never_uniform)


PATCH = Patch("uniform_kv_cache", "V1 runner: per-layer KV tensors, never one cross-layer buffer",
              BEFORE_BAND_C, (TARGET,), apply)
