"""vLLM's sleep mode with kvelastic: supported where the engine's pool is in its own process.

vLLM's sleep frees the weights and the KV cache through its CuMem allocator
(``--enable-sleep-mode``), and 0.31's ``release_kv_cache_memory`` frees the KV
cache alone. kvelastic's KV pages are reserved by the page pool, outside torch's
allocator, so the engine core gives them back itself when either runs
(``patches/sleep_mode.py``, :mod:`kvelastic.scheduler.hibernation`). Under worker
ranks (tensor or pipeline parallelism, Ray) the pages move only with the ranks'
steps, which a sleeping engine does not run: there sleep mode stops KV cache
initialisation and both calls are refused, each with a message that says why,
rather than run and say memory was freed.
"""

from __future__ import annotations

from kvelastic.errors import PatchError, UnsupportedOperation

_WHY = ("under worker ranks (tensor or pipeline parallelism, Ray) kvelastic's KV pages are given back by "
        "commands on the ranks' steps, which a sleeping engine does not run")


def refuse_sleep_mode(enabled: bool, under_ranks: bool) -> None:
    """Stop KV cache initialisation when ``ModelConfig.enable_sleep_mode`` is on under worker ranks."""
    if enabled and under_ranks:
        raise PatchError(f"kvelastic: vLLM's sleep mode (--enable-sleep-mode) is not supported with kvelastic "
                         f"{_WHY}. Run it on one GPU, without sleep mode, or with KVELASTIC=0")


def refuse_under_ranks(call: str) -> None:
    """``EngineCore.sleep`` / ``release_kv_cache_memory`` under worker ranks: refused before vLLM's method runs."""
    raise UnsupportedOperation(f"kvelastic: {call} is not supported with kvelastic {_WHY}, so no KV memory would "
                               "be freed. kvelastic unmaps idle KV pages by itself (after KVELASTIC_CACHE_TTL "
                               "seconds; a prefix cache reset frees every block); run with KVELASTIC=0 to use "
                               f"vLLM's own {call}")
