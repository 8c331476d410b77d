"""vLLM 0.29+, engine core: round ``num_blocks`` so layer-outermost layers start on whole pages.

In a layer-outermost layout (FlashAttention's default ``LBNHC``, the
OffloadingConnector's ``LBHNC``) layer ``l`` starts ``l * page * num_blocks``
bytes into the one KV backing. Unless that is a multiple of the pool page, every
layer's page groups straddle pages shared with their neighbours
(:mod:`kvelastic.worker.page_alignment`). vLLM derives ``num_blocks`` from
the memory it is given; kvelastic rounds it down to the nearest multiple that
aligns every layer, through vLLM's own ``num_gpu_blocks_override``, by planning
the configs a second time. Less than one multiple of blocks is lost (at most a
few hundred blocks of a virtual capacity of many thousands). A user's own
``num_gpu_blocks_override`` is kept as given.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvelastic.errors import LayoutError
from kvelastic.worker.page_alignment import aligned_num_blocks, layer_outermost_multiple
from kvelastic.startup.runtime import Runtime

log = logging.getLogger("vllm.kvelastic")


def plan_whole_pages(runtime: Runtime, plan: Callable[[], list[Any]], vllm_config: Any) -> list[Any]:
    """``plan()`` (vLLM's ``get_kv_cache_configs`` for ``vllm_config``), again with aligned ``num_blocks``."""
    configs = plan()
    cache_config = vllm_config.cache_config
    if not configs or cache_config.num_gpu_blocks_override is not None:
        return configs
    page_bytes = runtime.settings.chunk_bytes
    try:
        multiple = layer_outermost_multiple(configs[0], page_bytes)
    except ValueError as exc:  # a placement this rounding does not understand: it is an optimisation only
        log.warning("kvelastic: KV layers are left where vLLM put them, so page groups share boundary "
                    "pages (%s)", exc)
        return configs
    planned = configs[0].num_blocks
    if multiple is None or aligned_num_blocks(planned, multiple) == planned:
        return configs
    rounded = aligned_num_blocks(planned, multiple)
    cache_config.num_gpu_blocks_override = rounded
    try:
        configs = plan()
    finally:
        cache_config.num_gpu_blocks_override = None
    wrong = sorted({c.num_blocks for c in configs} - {rounded})
    if wrong:
        raise LayoutError(f"vLLM planned {wrong} KV blocks where kvelastic asked for {rounded} "
                          "(num_gpu_blocks_override)")
    log.info("kvelastic: %d KV blocks instead of %d, a multiple of %d, so that every layer of the "
             "layer-outermost KV cache starts on a whole %d-byte page", rounded, planned, multiple, page_bytes)
    return configs
