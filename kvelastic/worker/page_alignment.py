"""Page groups that own whole pages, in vLLM 0.29+'s one KV backing.

From 0.29 every layer's KV cache lives in one allocation, and block ``b`` of
layer ``l`` of a ``KVCacheTensor`` starts at ``offset + l*layer_stride +
b*block_stride``. A page group is ``k`` consecutive blocks. It owns whole pool
pages, sharing none with a neighbour, when every run of bytes it covers starts
and ends on a page boundary:

- the run starts of block 0 (``offset + l*layer_stride``, and the head runs of
  layouts that put heads outside blocks) are multiples of the page, and
- ``k * block_stride`` is a multiple of the page.

Block-outermost layouts have one run per block, at the start of the backing
(always page-aligned in the pool), so only ``k`` matters. Layer-outermost
layouts start layer ``l`` at ``l * page * num_blocks``: those starts are page
aligned only for some ``num_blocks``, which :func:`aligned_num_blocks` rounds
down to. A group that shares a boundary page with its neighbour still works
(the pool counts page references), but each shared page is mapped while either
side is, and the free-memory estimate charges a group for both.

Every ``KVCacheTensor`` of the config counts: HiSparse's host-resident ones
(0.30+) never reach an allocation kvelastic serves (``hisparse_refusal``).
"""

from __future__ import annotations

from math import gcd
from typing import Any, Iterable

#: Beyond this many pages a group is too coarse to follow load; today's band-B groups of an
#: 8B model (32 layers, K and V halves) are 64 pages, so this keeps band C no coarser.
MAX_GROUP_PAGES = 64


def lcm(a: int, b: int) -> int:
    return a // gcd(a, b) * b


def whole_page_blocks(block_stride: int, page_bytes: int, max_group_pages: int = MAX_GROUP_PAGES) -> int | None:
    """Blocks per group so that ``k * block_stride`` is a whole number of pages, or None.

    None where that group would span more than ``max_group_pages`` pages: the caller
    keeps ``max(1, page_bytes // block_stride)`` and lives with shared boundary pages.
    """
    if block_stride <= 0 or page_bytes <= 0:
        raise ValueError(f"block stride {block_stride} and page size {page_bytes} must be positive")
    span = lcm(block_stride, page_bytes)
    if span // page_bytes > max_group_pages:
        return None
    return span // block_stride


def blocks_per_group(block_strides: Iterable[int], page_bytes: int, max_group_pages: int = MAX_GROUP_PAGES) -> int:
    """Blocks per group whose span is whole pages at every one of ``block_strides``, where that stays within
    ``max_group_pages``; else the plain ``page_bytes // smallest stride``."""
    strides = sorted(set(block_strides))
    if not strides:
        raise ValueError("no block stride to group blocks by")
    blocks = 1
    for stride in strides:
        whole = whole_page_blocks(stride, page_bytes, max_group_pages)
        if whole is None:
            break
        blocks = lcm(blocks, whole)
    else:
        if blocks * strides[-1] // page_bytes <= max_group_pages:
            return blocks
    return max(1, page_bytes // strides[0])


def num_blocks_multiple(bytes_per_block_of_run: Iterable[int], page_bytes: int) -> int:
    """The ``m`` such that every run start ``c * num_blocks`` is page-aligned when ``m | num_blocks``.

    In a layer-outermost layout each run of block 0 starts at ``c * num_blocks`` bytes
    for a fixed ``c`` per run (``l * page`` for layer ``l``, plus the earlier specs'
    layers, plus ``h * page / H`` for head ``h`` where heads sit outside blocks).
    """
    multiple = 1
    for c in bytes_per_block_of_run:
        if c < 0:
            raise ValueError(f"a run cannot start at {c} bytes per block")
        if c:
            multiple = lcm(multiple, page_bytes // gcd(page_bytes, c))
    return multiple


def aligned_num_blocks(num_blocks: int, multiple: int) -> int:
    """``num_blocks`` rounded down to a multiple of ``multiple``; unchanged where that leaves none."""
    if num_blocks <= 0 or multiple <= 0:
        raise ValueError(f"num_blocks {num_blocks} and multiple {multiple} must be positive")
    rounded = num_blocks - num_blocks % multiple
    return rounded if rounded > 0 else num_blocks


def run_starts_aligned(starts: Iterable[int], page_bytes: int) -> bool:
    return all(start % page_bytes == 0 for start in starts)


def group_blocks_of_config(kv_cache_config: Any, page_bytes: int) -> int | None:
    """Blocks per group for a 0.29+ ``KVCacheConfig``: whole pages where that stays small enough.

    The tensors of one backing share one block stride, except layer-outermost layers
    of different page sizes in one group, which step with their own page; the group
    is then whole pages at each stride where that stays small. None where there is
    no tensor.
    """
    strides = {t.block_stride for t in kv_cache_config.kv_cache_tensors}
    if not strides:
        return None
    return blocks_per_group(strides, page_bytes)


def layer_outermost_multiple(kv_cache_config: Any, page_bytes: int) -> int | None:
    """What ``num_blocks`` must be a multiple of for every layer to start on a page; None if no need.

    None for block-outermost layouts (a layer's page sits inside each block, whose
    runs start at the page-aligned backing) and for configs without tensors.
    """
    num_blocks = kv_cache_config.num_blocks
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors or any(t.layer_stride < num_blocks * t.block_stride for t in tensors):
        return None
    if any(t.offset % num_blocks or t.layer_stride % num_blocks for t in tensors):
        raise ValueError(f"a layer-outermost KV tensor does not start its layers at multiples of "
                         f"num_blocks={num_blocks}: {tensors}")
    coefficients = [c for t in tensors for c in (t.offset // num_blocks, t.layer_stride // num_blocks,
                                                 t.block_stride)]
    return num_blocks_multiple(coefficients, page_bytes)
