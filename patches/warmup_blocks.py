"""vLLM 0.34+: the blocks vLLM's warm-up addresses are mapped before it addresses them.

vLLM 0.34 warms its kernels up with made-up requests on blocks numbered from 1: one
request per ``max_num_seqs`` for the kernel warm-up, a mixed prefill and decode step
of a whole batch, a prefill over cached context. Each first calls
``ensure_kv_cache_blocks(runner, num_blocks)``, the seam vLLM's extensible KV cache
commits its prefix through; with that cache off (``patches/extensible_kv_cache.py``)
vLLM's function does nothing and kvelastic serves the seam: the page groups of blocks
``[0, num_blocks)`` are mapped (``kvelastic/worker/extensible.py``), so no warm-up
kernel reads or writes an unmapped page, whatever ``max_num_seqs`` is.

The name is wrapped where vLLM defines it (warm-ups that import it as they run) and
in each module that imports it by name when loaded.
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import BAND_D

_SHAPES = (Signature(BAND_D, ("runner", "num_blocks")),)
DEFINED = Target(module="vllm.v1.worker.extensible_kv_cache", qualname="ensure_kv_cache_blocks", kind="function",
                 shapes=_SHAPES)
#: The warm-up modules that import the name when they are loaded.
IMPORTED = tuple(Target(module=module, qualname="ensure_kv_cache_blocks", kind="function", shapes=_SHAPES)
                 for module in ("vllm.v1.worker.gpu.warmup",
                                "vllm.model_executor.warmup.flashinfer_sparse_mla_warmup"))


def _ensure(runtime: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    from kvelastic.patches._common import argument
    from kvelastic.worker.extensible import map_warmup_blocks

    wrapped(*args, **kwargs)
    map_warmup_blocks(runtime.cache, argument(wrapped, args, kwargs, "num_blocks"))


def apply(patcher: Any, runtime: Any) -> None:
    for target in (DEFINED, *IMPORTED):
        patcher.wrap(target, functools.partial(_ensure, runtime))


PATCH = Patch("warmup_blocks", "Worker: the blocks vLLM's warm-up addresses mapped first (0.34+)", BAND_D,
              (DEFINED, *IMPORTED), apply)
