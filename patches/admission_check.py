"""KVCacheManager: vLLM 0.19.0-0.20.1's whole-sequence admission check maps nothing.

The commit guard (``kvelastic/integration/commit_guard.py``) maps, on vLLM's
block estimate, what the allocation that follows will take. From 0.20.2 on,
estimates that only admit a request carry ``apply_admission_cap=True``; in
0.19.0-0.20.1 ``can_fit_full_sequence`` asks for the whole sequence without
that flag, and nothing is allocated after it. Mapping for it would map a long
prompt's every group up front and then release the surplus. Within this call
the guard therefore maps nothing; the allocation's own estimate comes next.
"""

from __future__ import annotations

from typing import Any

from kvelastic.integration.commit_guard import guard_of
from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patching.versions import VersionRange

UNFLAGGED = VersionRange.of("0.19", "0.20.2")

TARGET = Target(
    module="vllm.v1.core.kv_cache_manager",
    qualname="KVCacheManager.can_fit_full_sequence",
    kind="method",
    signatures=(Signature(UNFLAGGED, ("self", "request", "num_new_computed_tokens", "new_computed_blocks",
                                      "num_external_computed_tokens", "num_encoder_tokens")),),
)


def _can_fit(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> bool:
    guard = guard_of(instance)
    if guard is None:  # not the scheduler's GPU manager (or kvelastic did not attach): vLLM as is
        return wrapped(*args, **kwargs)
    with guard.admission():
        return wrapped(*args, **kwargs)


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, _can_fit)


PATCH = Patch("admission_check", "KVCacheManager: the admission check maps nothing (0.19.0-0.20.1)",
              UNFLAGGED, (TARGET,), apply)
