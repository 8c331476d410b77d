"""vLLM 0.29+: sleep mode is refused while kvelastic backs the KV cache.

vLLM's sleep mode (``--enable-sleep-mode``) frees GPU memory through its CuMem
allocator: ``Worker.sleep`` suspends the ``weights`` and ``kv_cache`` pools, and
0.31's ``release_kv_cache_memory`` discards the ``kv_cache`` pool. kvelastic's
KV backing is reserved by the page pool, outside torch's allocator, so none of
it is in that pool: sleeping would report memory freed while every mapped KV
page stays mapped. Until kvelastic releases its own pages on those calls
(docs/vllm-0.29.md, "Sleep mode"), the combination stops at KV cache
initialisation with this message rather than run and say something false.
"""

from __future__ import annotations

from typing import Any

from kvelastic.errors import PatchError


def refuse_sleep_mode(vllm_config: Any) -> None:
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enable_sleep_mode", False):
        raise PatchError("kvelastic: vLLM's sleep mode (--enable-sleep-mode) is not supported with kvelastic "
                         "on vLLM 0.29+: sleep and release_kv_cache_memory free vLLM's CuMem pool, which does "
                         "not hold kvelastic's KV pages. Run without sleep mode, or with KVELASTIC=0")
