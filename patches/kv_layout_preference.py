"""vLLM 0.29+, worker: report block-outermost KV layouts first where no kernel block split follows.

The engine core resolves one layout from what the workers report; a user's or a
connector's choice still wins. See ``kvelastic/integration/layout_preference.py``
for when the order changes and why no token moves.
"""

from __future__ import annotations

from typing import Any

from kvelastic.integration.layout_preference import preferred_layouts
from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._band_c import BAND_C

TARGET = Target(
    module="vllm.v1.worker.worker_base",
    qualname="WorkerBase.get_supported_kv_cache_layouts",
    kind="method",
    signatures=(Signature(BAND_C, ("self",)),),
)


def _layouts(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> list[str]:
    return preferred_layouts(instance, wrapped(*args, **kwargs))


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, _layouts)


PATCH = Patch("kv_layout_preference", "Worker: block-outermost KV layouts first where kernel blocks are whole",
              BAND_C, (TARGET,), apply)
