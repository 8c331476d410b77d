"""vLLM 0.34+: kvelastic's KV cache in place of vLLM's extensible one, under vLLM's rule for such a cache.

vLLM 0.34's ``request_memory(init_snapshot, cache_config, external_weight_memory)``
turns ``gpu_memory_utilization`` into the engine's memory budget. For a KV cache
reserved up front it refuses to start when less than that share of the GPU is
free; for its own extensible cache it does not ("the budget is only a cap"), and an
unset utilization means 1.0 there. kvelastic's KV cache is extensible in the same
sense (virtual, mapped on use, and its physical bytes are granted by the GPU's
shared account, not by this budget), so the same rule applies to it. vLLM computes
it, from a shallow copy of the cache config whose one change is that flag: the
engine's own config keeps saying that vLLM's extensible cache is off.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

#: What each worker answers when vLLM asks why it cannot back vLLM's extensible KV cache; vLLM logs it.
REASON = ("kvelastic serves the KV cache from its elastic page pool (grown and shrunk while serving, shared "
          "with the other engines on the GPU); KVELASTIC=0 gives vLLM's extensible KV cache back")


def as_extensible(cache_config: Any) -> Any:
    """A shallow copy of ``cache_config`` that says the KV cache is extensible (the original is untouched)."""
    view = copy.copy(cache_config)
    object.__setattr__(view, "enable_extensible_kv_cache", True)
    return view


def request_memory_as_extensible(request_memory: Callable[..., int], args: tuple, kwargs: dict) -> int:
    """vLLM's ``request_memory`` judged as for an extensible KV cache: a cap, 1.0 when unset."""
    bound = inspect.signature(request_memory).bind(*args, **kwargs)
    bound.arguments["cache_config"] = as_extensible(bound.arguments["cache_config"])
    return int(request_memory(*bound.args, **bound.kwargs))
