"""Engine core, vLLM 0.31+: ``release_kv_cache_memory`` is refused with a clear message.

0.31 added ``EngineCore.release_kv_cache_memory`` (``LLM.release_kv_cache_memory``,
``POST /release_kv_cache_memory`` on the dev router): with the scheduler paused
it resets the prefix cache and discards the CuMem ``kv_cache`` pool. kvelastic's
pages are in no such pool, so the call would free nothing while saying it had
(``kvelastic/worker/sleep_mode.py``). The wrapper raises before vLLM's own
method runs, so nothing is reset or marked asleep; the engine core reports a
failed utility call to its client and goes on serving.
"""

from __future__ import annotations

from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import since

WITH_RELEASE = since("0.31")

TARGET = Target(
    module="vllm.v1.engine.core",
    qualname="EngineCore.release_kv_cache_memory",
    kind="method",
    shapes=(Signature(VersionRange.of("0.31", "0.34"), ("self",)),
            Signature(since("0.34"), ("self", "reset_connector"))),
)


def _refuse(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    from kvelastic.worker.sleep_mode import refuse_release_kv_cache_memory

    refuse_release_kv_cache_memory()


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, _refuse)


PATCH = Patch("release_kv_cache_refusal", "Engine core: release_kv_cache_memory refused (0.31+)", WITH_RELEASE,
              (TARGET,), apply)
