"""vLLM 0.30+: HiSparse KV caches are refused with kvelastic on.

HiSparse keeps part of the KV cache in host memory and hands some layers vLLM's
raw backing (specs without per-layer views) whose blocks it places itself; its
coordinator also leaves freed blocks readable until reuse
(``BlockPool.unpin_blocks``), which kvelastic would unmap. None of that fits a
page pool that maps blocks by their place in per-layer views, so the HiSparse
allocation stops with a clear error before anything is allocated.
"""

from __future__ import annotations

from typing import Any

from kvelastic.errors import LayoutError
from kvelastic.patching.spec import Patch
from kvelastic.patches._common import since
from kvelastic.patches.single_backing import allocator_name

WITH_HISPARSE = since("0.30")  # vllm.v1.hisparse exists

TARGET = allocator_name("vllm.v1.hisparse.binding")


def _refuse(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    raise LayoutError("kvelastic does not support HiSparse KV caches (host-resident tensors, raw "
                      "per-layer backings, blocks readable after they are freed); run this model "
                      "with KVELASTIC=0 or without HiSparse")


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, _refuse)


PATCH = Patch("hisparse_refusal", "HiSparse: refused with a clear message (0.30+)", WITH_HISPARSE, (TARGET,), apply)
