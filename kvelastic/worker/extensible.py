"""vLLM 0.34+: kvelastic's KV cache in place of vLLM's extensible one, under vLLM's rule for such a cache.

vLLM 0.34's ``request_memory(init_snapshot, cache_config, external_weight_memory)``
turns ``gpu_memory_utilization`` into the engine's memory budget. For a KV cache
reserved up front it refuses to start when less than that share of the GPU is
free; for its own extensible cache it does not ("the budget is only a cap").
kvelastic's KV cache is extensible in that sense (virtual, mapped on use, its
physical bytes granted by the GPU's shared account), so the budget is judged as a
cap: a second ``vllm serve`` on a GPU that a first one shares starts.

The share itself stays the one the engine's sizing resolves: with vLLM's
extensible cache off (kvelastic turns it off), an unset utilization is vLLM's
estimate-based default (0.92), not the extensible cache's 1.0. That 1.0 is safe
only because vLLM then measures memory after warm-up and CUDA graph capture and
keeps a margin; kvelastic's limit comes from vLLM's profiling estimate, as on
0.29-0.33. vLLM computes the budget itself, from a shallow copy of the cache
config: the engine's own config is not changed.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

#: What each worker answers when vLLM asks why it cannot back vLLM's extensible KV cache; vLLM logs it.
REASON = ("kvelastic serves the KV cache from its elastic page pool (grown and shrunk while serving, shared "
          "with the other engines on the GPU); KVELASTIC=0 gives vLLM's extensible KV cache back")


def as_budget_cap(cache_config: Any) -> Any:
    """A shallow copy of ``cache_config`` with its resolved utilization, that says the cache is extensible."""
    view = copy.copy(cache_config)
    object.__setattr__(view, "gpu_memory_utilization", cache_config.resolved_gpu_memory_utilization)
    object.__setattr__(view, "enable_extensible_kv_cache", True)
    return view


def request_memory_as_extensible(request_memory: Callable[..., int], args: tuple, kwargs: dict) -> int:
    """vLLM's ``request_memory`` with the budget judged as a cap, for the utilization the engine resolves."""
    bound = inspect.signature(request_memory).bind(*args, **kwargs)
    bound.arguments["cache_config"] = as_budget_cap(bound.arguments["cache_config"])
    return int(request_memory(*bound.args, **bound.kwargs))


def map_warmup_blocks(cache: Any, num_blocks: int) -> None:
    """Map the page groups of blocks ``[0, num_blocks)``, which vLLM's warm-up is about to address.

    vLLM 0.34's warm-ups run made-up requests on blocks numbered from 1 (one per
    ``max_num_seqs`` for the kernel warm-up) and first ask for those blocks through
    ``ensure_kv_cache_blocks``, the call its extensible cache commits a prefix on.
    ``cache``: this process's published KV cache (None before one is published).
    """
    if cache is not None and num_blocks > 0:
        cache.map_first_blocks(int(num_blocks), force=True)
