"""vLLM 0.29+, worker: ask for a block-outermost KV layout where it changes nothing vLLM computes.

Each worker reports the KV layouts its attention backends support, most
preferred first; the engine core takes the first one that fits, unless the user
(``VLLM_KV_CACHE_LAYOUT``, ``cache_config.kv_cache_layout``) or a KV connector
(the OffloadingConnector asks for ``LBHNC``) chose already. kvelastic moves the
block-outermost layouts of that list to its front: then a page group is one
contiguous range of the backing, whole pages of it (see
:mod:`kvelastic.worker.page_alignment`).

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
other non-attention state, HiSparse's specs without layer views, mixed page
sizes that vLLM may re-block later, MLA, whose ``storage_block_size`` of
0.30-0.31 forces a split) keeps vLLM's order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

#: ``select(block_size, backends, spec)``: vLLM's common kernel block size for one spec's layers
#: (``patches/kv_layout_preference.py:common_block_size`` picks the release's call).
SelectBlockSize = Callable[[int, list[Any], Any], int]


def block_outermost_first(names: Sequence[str], is_block_outermost: Callable[[str], bool]) -> list[str]:
    """``names`` with the block-outermost ones moved to the front, each part in its own order."""
    return ([name for name in names if is_block_outermost(name)]
            + [name for name in names if not is_block_outermost(name)])


def whole_blocks_everywhere(specs: Iterable[Any], backends: Sequence[Any], select: SelectBlockSize,
                            is_plain_attention: Callable[[Any], bool]) -> bool:
    """True where every layer is plain attention of one block size that every backend takes whole."""
    specs = list(specs)
    if not specs or not backends or not all(is_plain_attention(spec) for spec in specs):
        return False
    if len({(spec.block_size, spec.page_size_bytes) for spec in specs}) != 1:
        return False
    block_size = specs[0].block_size
    try:
        return all(select(block_size, list(backends), spec) == block_size
                   for spec in {id(spec): spec for spec in specs}.values())
    except ValueError:  # no common kernel block size at all: leave the choice to vLLM
        return False


def plain_attention(spec: Any) -> bool:
    """An attention spec other than MLA's (whose 0.30-0.31 ``storage_block_size`` forces a kernel split)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    return isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec)


def preferred_layouts(worker: Any, reported: list[str], select: SelectBlockSize) -> list[str]:
    """The worker's reported layouts, block-outermost first where :func:`whole_blocks_everywhere` allows."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import worker_base

    try:
        specs = worker.get_kv_cache_spec().values()
    except NotImplementedError:  # a worker class without KV specs: nothing to judge by
        return reported
    backends = worker_base.get_current_attn_backends(worker.vllm_config)
    if not whole_blocks_everywhere(specs, backends, select, plain_attention):
        return reported
    return block_outermost_first(reported, lambda name: KVCacheLayout[name].is_block_outermost)
