"""vLLM 0.29+: sleep mode and ``release_kv_cache_memory`` are refused while kvelastic backs the KV cache.

vLLM's sleep mode (``--enable-sleep-mode``) frees GPU memory through its CuMem
allocator: ``Worker.sleep`` suspends the ``weights`` and ``kv_cache`` pools, and
0.31's ``release_kv_cache_memory`` discards the ``kv_cache`` pool. kvelastic's
KV backing is reserved by the page pool, outside torch's allocator, so none of
it is in that pool: either call would report memory freed while every mapped KV
page stays mapped. Until kvelastic releases its own pages on those calls
(docs/vllm-0.29.md, "Sleep mode"), sleep mode stops KV cache initialisation,
and ``release_kv_cache_memory`` (which needs no sleep mode) fails before it
changes anything, each with a message that says why, rather than run and say
something false.
"""

from __future__ import annotations

from kvelastic.errors import PatchError, UnsupportedOperation


def refuse_sleep_mode(enabled: bool) -> None:
    """Stop KV cache initialisation when ``ModelConfig.enable_sleep_mode`` is on, saying why."""
    if enabled:
        raise PatchError("kvelastic: vLLM's sleep mode (--enable-sleep-mode) is not supported with kvelastic "
                         "on vLLM 0.29+: sleep and release_kv_cache_memory free vLLM's CuMem pool, which does "
                         "not hold kvelastic's KV pages. Run without sleep mode, or with KVELASTIC=0")


def refuse_release_kv_cache_memory() -> None:
    """``EngineCore.release_kv_cache_memory`` (0.31+): refused before it resets or discards anything."""
    raise UnsupportedOperation(
        "kvelastic: release_kv_cache_memory is not supported while kvelastic backs the KV cache: it discards "
        "vLLM's CuMem kv_cache pool, which holds none of kvelastic's KV pages, so no memory would be freed. "
        "kvelastic unmaps idle KV pages by itself (after KVELASTIC_CACHE_TTL seconds; a prefix cache reset "
        "frees every block); run with KVELASTIC=0 to use vLLM's own release")
