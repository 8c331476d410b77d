"""vLLM's block estimate, and how to tell an admission check from an allocation's estimate.

The commit guard (``kvelastic/hooks/commit_guard.py``) wraps
``KVCacheCoordinator.get_num_blocks_to_allocate`` on the scheduler's
coordinator and maps, on vLLM's estimate, what the allocation that follows
will take. Admission checks ask about a whole sequence and allocate nothing;
mapping for one would map a long prompt's every group up front and then
release the surplus, so the guard must recognise them. Every release's way of
saying "admission check" is handled in this module:

- 0.20.2 and later pass ``apply_admission_cap=True`` to the estimate
  (:func:`is_admission_check` reads it, positionally or by keyword, at the
  position the estimate's declared parameters give);
- 0.19.0-0.20.1's ``KVCacheManager.can_fit_full_sequence`` asks without that
  flag; the ``admission_check`` patch wraps it there so the guard maps nothing
  within the call (the allocation's own estimate comes next);
- before 0.19 there are no admission checks.
"""

from __future__ import annotations

from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import before, since

FLAG = "apply_admission_cap"
UNFLAGGED = VersionRange.of("0.19", "0.20.2")

_ESTIMATE = ("self", "request_id", "num_tokens", "new_computed_blocks", "num_encoder_tokens")
ESTIMATE = Target(  # wrapped on the scheduler's coordinator instance; the class keeps vLLM's function
    module="vllm.v1.core.kv_cache_coordinator",
    qualname="KVCacheCoordinator.get_num_blocks_to_allocate",
    kind="method",
    use="instance",
    shapes=(Signature(before("0.14"), _ESTIMATE),
            Signature(VersionRange.of("0.14", "0.15"), (*_ESTIMATE, "total_computed_tokens")),
            Signature(VersionRange.of("0.15", "0.20.2"), (*_ESTIMATE, "total_computed_tokens",
                                                           "num_tokens_main_model")),
            Signature(VersionRange.of("0.20.2", "0.26"), (*_ESTIMATE, "total_computed_tokens",
                                                          "num_tokens_main_model", FLAG)),
            Signature(VersionRange.of("0.26", "0.31"), (*_ESTIMATE, "total_computed_tokens",
                                                        "num_local_computed_tokens", "num_tokens_main_model", FLAG)),
            Signature(since("0.31"), (*_ESTIMATE, "total_computed_tokens", "num_local_computed_tokens",
                                      "num_tokens_main_model", FLAG, "prefill_end"))),
)
CAN_FIT = Target(
    module="vllm.v1.core.kv_cache_manager",
    qualname="KVCacheManager.can_fit_full_sequence",
    kind="method",
    shapes=(Signature(UNFLAGGED, ("self", "request", "num_new_computed_tokens", "new_computed_blocks",
                                  "num_external_computed_tokens", "num_encoder_tokens")),),
)


def flag_index(estimate_params: tuple[str, ...]) -> int | None:
    """Where the admission flag sits among a bound estimate's arguments (after ``self``); None: the
    running release's estimate has no flag, so no estimate call is an admission check."""
    return estimate_params.index(FLAG) - 1 if FLAG in estimate_params else None


def is_admission_check(flag_at: int | None, args: tuple, kwargs: dict) -> bool:
    """Whether an estimate called with ``args``/``kwargs`` (``self`` bound) passed the admission flag.

    ``flag_at``: :func:`flag_index` of the estimate's declared parameters, worked out once.
    """
    if flag_at is None:
        return False
    return bool(args[flag_at] if len(args) > flag_at else kwargs.get(FLAG))


def _can_fit(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> bool:
    from kvelastic.hooks.commit_guard import guard_of

    guard = guard_of(instance)
    if guard is None:  # not the scheduler's GPU manager (or kvelastic did not attach): vLLM as is
        return wrapped(*args, **kwargs)
    with guard.admission():
        return wrapped(*args, **kwargs)


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(CAN_FIT, _can_fit)


PATCH = Patch("admission_check", "KVCacheManager: the admission check maps nothing (0.19.0-0.20.1)",
              UNFLAGGED, (CAN_FIT,), apply)
