"""vLLM 0.29+, worker: ask for a block-outermost KV layout where it changes nothing vLLM computes.

Each worker reports the KV layouts its attention backends support, most
preferred first; the engine core takes the first one that fits, unless the user
(``VLLM_KV_CACHE_LAYOUT``, ``cache_config.kv_cache_layout``) or a KV connector
(the OffloadingConnector asks for ``LBHNC``) chose already. kvelastic moves the
block-outermost layouts of that list to its front: then a page group is one
contiguous range of the backing, whole pages of it (see
:mod:`kvelastic.integration.page_alignment`).

Only the order changes, never the set, and only where no kernel block split
would follow. A layout moves no token: the same blocks hold the same tokens,
the bytes of a block are only placed differently. Kernel block splitting
(kernel blocks smaller than vLLM's block) is where a layout could matter: in
0.29-0.31 a split block-outermost layout fails in ``create_kv_cache_views``,
and from 0.32 vLLM stops splitting under block-outermost layouts, which would
hand a backend a block size it did not declare. So the reorder is made only
when every layer is plain attention, all with one block size and page size,
and every backend takes that block size whole (vLLM's own
``select_common_block_size`` returns it unchanged). Anything else (Mamba or
other non-attention state, mixed page sizes that vLLM may re-block later,
MLA's ``storage_block_size`` of 0.30-0.31) keeps vLLM's order.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Sequence


def block_outermost_first(names: Sequence[str], is_block_outermost: Callable[[str], bool]) -> list[str]:
    """``names`` with the block-outermost ones moved to the front, each part in its own order."""
    return ([name for name in names if is_block_outermost(name)]
            + [name for name in names if not is_block_outermost(name)])


def whole_blocks_everywhere(specs: Iterable[Any], backends: Sequence[Any], select_common_block_size: Callable[..., int],
                            attention_spec: type) -> bool:
    """True where every layer is attention of one block size that every backend takes whole."""
    specs = [spec for spec in specs if getattr(spec, "has_layer_views", True)]
    if not specs or not backends or not all(isinstance(spec, attention_spec) for spec in specs):
        return False
    if len({(spec.block_size, spec.page_size_bytes) for spec in specs}) != 1:
        return False
    block_size = specs[0].block_size
    if any(getattr(spec, "storage_block_size", None) not in (None, block_size) for spec in specs):
        return False
    per_spec = "kv_cache_specs" in inspect.signature(select_common_block_size).parameters  # 0.32+
    try:
        if not per_spec:
            return select_common_block_size(block_size, list(backends)) == block_size
        return all(select_common_block_size(block_size, list(backends), [spec] * len(backends)) == block_size
                   for spec in {id(spec): spec for spec in specs}.values())
    except ValueError:  # no common kernel block size at all: leave the choice to vLLM
        return False


def preferred_layouts(worker: Any, reported: list[str]) -> list[str]:
    """The worker's reported layouts, block-outermost first where :func:`whole_blocks_everywhere` allows."""
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker import worker_base

    try:
        specs = worker.get_kv_cache_spec().values()
    except NotImplementedError:  # a worker class without KV specs: nothing to judge by
        return reported
    backends = worker_base.get_current_attn_backends(worker.vllm_config)
    if not whole_blocks_everywhere(specs, backends, worker_utils.select_common_block_size, AttentionSpec):
        return reported
    return block_outermost_first(reported, lambda name: KVCacheLayout[name].is_block_outermost)
