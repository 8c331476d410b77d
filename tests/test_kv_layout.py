"""Block footprints read off real torch views in the layouts vLLM's backends use."""

from __future__ import annotations

import pytest
import torch

from kvelastic.errors import LayoutError
from kvelastic.pool.kv_layout import BlockRuns, KVGroupLayout, merge_runs, runs_of_view
from kvelastic.pool.layout import PageRef

N, BS, H, D = 64, 16, 2, 32  # blocks, tokens per block, kv heads, head size
HALF = BS * H * D * 2  # bytes of K (or V) of one block in bf16


def _runs(view: torch.Tensor, base: torch.Tensor, num_blocks: int = N):
    offset = view.data_ptr() - base.data_ptr()
    return runs_of_view(view.shape, view.stride(), view.element_size(), offset, num_blocks)


def test_flash_attention_layout_splits_k_and_v():
    raw = torch.zeros(2 * N * HALF, dtype=torch.int8)
    view = raw.view(torch.bfloat16).view(2, N, BS, H, D)
    stride, runs = _runs(view, raw)
    assert stride == HALF
    assert runs == ((0, HALF), (N * HALF, HALF))


def test_blocks_first_layout_is_one_run():
    raw = torch.zeros(2 * N * HALF, dtype=torch.int8)
    view = raw.view(torch.bfloat16).view(N, 2, BS, H, D)
    assert _runs(view, raw) == (2 * HALF, ((0, 2 * HALF),))


def test_permuted_stride_order_is_read_from_strides():
    raw = torch.zeros(2 * N * HALF, dtype=torch.int8)
    physical = raw.view(torch.bfloat16).view(2, N, H, BS, D)  # HND physical order
    logical = physical.permute(0, 1, 3, 2, 4)  # the (2, N, BS, H, D) view vLLM hands to kernels
    assert _runs(logical, raw) == (HALF, ((0, HALF), (N * HALF, HALF)))


def test_hybrid_restride_makes_blocks_contiguous():
    raw = torch.zeros(2 * N * HALF, dtype=torch.int8)
    view = raw.view(torch.bfloat16).view(2, N, BS, H, D)
    hidden = BS * H * D
    view = view.as_strided(view.shape, (hidden, 2 * hidden, H * D, D, 1))
    assert _runs(view, raw) == (2 * HALF, ((0, 2 * HALF),))


def test_kernel_block_split_counts_as_one_block():
    raw = torch.zeros(2 * N * HALF, dtype=torch.int8)
    view = raw.view(torch.bfloat16).view(2, 4 * N, BS // 4, H, D)  # kernel blocks of 4 tokens
    assert _runs(view, raw) == (HALF, ((0, HALF), (N * HALF, HALF)))


def test_packed_layers_share_a_block_stride():
    page = 2 * HALF
    raw = torch.zeros(N * 2 * page, dtype=torch.int8)  # two layers interleaved per block
    layer0 = raw.view(N, 2 * page)[:, :page].view(torch.bfloat16).view(N, 2, BS, H, D)
    layer1 = raw.view(N, 2 * page)[:, page:].view(torch.bfloat16).view(N, 2, BS, H, D)
    merged = merge_runs([(7, *_runs(layer0, raw)), (7, *_runs(layer1, raw))])
    assert merged == [BlockRuns(7, 2 * page, ((0, 2 * page),))]


def test_ambiguous_views_are_refused():
    raw = torch.zeros(4 * 4 * 64, dtype=torch.int8)
    with pytest.raises(LayoutError):
        runs_of_view((4, 4, 64), (256, 64, 1), 1, 0, 4)
    assert raw.numel() == 1024


def test_views_of_one_region_with_different_strides_keep_runs_of_their_own():
    """vLLM 0.29+, layer-outermost: layers of 64- and 128-byte pages step through one backing differently."""
    n = 16
    small = (0, 64, ((0, 64),))                   # a layer of 64-byte blocks at [0, 16 * 64)
    large = (0, 128, ((n * 64, 128),))            # then a layer of 128-byte blocks
    merged = merge_runs([large, small, (0, 64, ((0, 64),))])
    assert merged == [BlockRuns(0, 64, ((0, 64),)), BlockRuns(0, 128, ((n * 64, 128),))]
    layout = KVGroupLayout(merged, n, 256, blocks_per_group=4)
    # group 1 = blocks 4-7: bytes [256, 512) of the small layer, [1024 + 512, 1024 + 1024) of the large one
    assert layout.pages(1) == [PageRef(0, 1), PageRef(0, 6), PageRef(0, 7)]
    shared = KVGroupLayout([BlockRuns(0, 64, ((0, 64),)), BlockRuns(0, 32, ((0, 32),))], n, 256, 4)
    assert shared.pages(0) == [PageRef(0, 0)]  # a page both strides touch is listed once


def test_group_pages_cover_both_halves_and_share_unaligned_boundaries():
    page = 8 * HALF
    aligned = KVGroupLayout([BlockRuns(0, HALF, ((0, HALF), (N * HALF, HALF)))], N, page)
    assert aligned.blocks_per_group == 8 and aligned.num_groups == 8
    assert aligned.pages(1) == [PageRef(0, 1), PageRef(0, 9)]
    odd_n = N - 4  # the V half now starts in the middle of a page
    shifted = KVGroupLayout([BlockRuns(0, HALF, ((0, HALF), (odd_n * HALF, HALF)))], odd_n, page)
    assert shifted.pages(0) == [PageRef(0, 0), PageRef(0, 7), PageRef(0, 8)]
    assert shifted.pages(1) == [PageRef(0, 1), PageRef(0, 8), PageRef(0, 9)]
    assert list(shifted.blocks_of_group(shifted.num_groups - 1)) == list(range(56, 60))
