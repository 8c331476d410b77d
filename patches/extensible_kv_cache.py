"""vLLM 0.34+: vLLM's own extensible KV cache is turned off; kvelastic's pool takes its place.

vLLM 0.34 reserves the KV cache on CUDA virtual memory itself
(``vllm/v1/worker/extensible_kv_cache.py``, on by default on CUDA): it commits a
prefix of blocks, sizes the cache once after warm-up and CUDA graph capture, and
never gives memory back while serving. kvelastic replaces it rather than build on
it (``docs/vllm-0.34.md`` says why): the pool unmaps page groups anywhere, shrinks
while serving and shares the GPU's account with the other engines.

Two contacts, both of the worker:

- ``Worker.extensible_kv_cache_unsupported_reason`` (wrapped): the engine core asks
  every worker whether it can back vLLM's extensible cache and, on any reason,
  turns it off everywhere itself (``Executor.disable_extensible_kv_cache``, which
  logs the reason). Each worker answers kvelastic's reason; vLLM's own answer (an
  all-reduce over the ranks) is not asked, on any rank alike. The allocation then
  takes vLLM's ordinary path, whose ``allocate`` hook kvelastic serves
  (``patches/single_backing.py``).
- ``gpu_worker:request_memory`` (wrapped, imported by name from
  ``vllm.v1.worker.utils``): the engine's memory budget. vLLM's rule for an
  extensible cache applies to kvelastic's, which maps pages only as they are used:
  the budget is a cap, not memory that must be free at start-up. The share is the
  one the engine resolves (unset: vLLM's estimate-based 0.92, since kvelastic's
  limit comes from the profiling estimate). vLLM's own function computes it, over a
  copy of the cache config; without this a second ``vllm serve`` on a GPU the first
  one shares would be refused at start-up (``kvelastic/worker/extensible.py``).
"""

from __future__ import annotations

from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import BAND_D
from kvelastic.patches.engine_config import CACHE_CONFIG

_WORKER = "vllm.v1.worker.gpu_worker"
UNSUPPORTED_REASON = Target(
    module=_WORKER,
    qualname="Worker.extensible_kv_cache_unsupported_reason",
    kind="method",
    shapes=(Signature(BAND_D, ("self",)),),
)
REQUEST_MEMORY = Target(
    module=_WORKER,
    qualname="request_memory",
    kind="function",
    shapes=(Signature(BAND_D, ("init_snapshot", "cache_config", "external_weight_memory")),),
)
TARGETS = (UNSUPPORTED_REASON, REQUEST_MEMORY, CACHE_CONFIG)  # the cache config: which sizing rule applies


def _reason(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> str:
    from kvelastic.worker.extensible import REASON

    return REASON


def _request_memory(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> int:
    from kvelastic.worker.extensible import request_memory_as_extensible

    return request_memory_as_extensible(wrapped, args, kwargs)


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(UNSUPPORTED_REASON, _reason)
    patcher.wrap(REQUEST_MEMORY, _request_memory)


PATCH = Patch("extensible_kv_cache", "Worker: vLLM's extensible KV cache off, its budget rule kept for kvelastic's "
              "(0.34+)", BAND_D, TARGETS, apply)
