"""Whole-page group arithmetic for vLLM 0.29+'s one KV backing (no vLLM needed).

The layouts themselves, built by vLLM's own planner and views, are checked in
``test_single_backing.py`` (vLLM 0.29+ installed).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvelastic.worker.layout_preference import block_outermost_first
from kvelastic.worker.page_alignment import (
    MAX_GROUP_PAGES,
    aligned_num_blocks,
    blocks_per_group,
    group_blocks_of_config,
    layer_outermost_multiple,
    num_blocks_multiple,
    whole_page_blocks,
)

KIB, MIB = 1024, 1024**2
PAGES = st.sampled_from([64 * KIB, 2 * MIB, 8 * MIB, 32 * MIB])
STRIDES = st.integers(1, 4096).map(lambda n: n * 512)  # block strides are whole multiples of small powers of 2


@given(STRIDES, PAGES)
def test_whole_page_groups_are_the_smallest_whole_number_of_pages(stride, page):
    k = whole_page_blocks(stride, page)
    if k is None:
        assert stride * page // math.gcd(stride, page) // page > MAX_GROUP_PAGES
        assert blocks_per_group([stride], page) == max(1, page // stride)
        return
    assert k * stride % page == 0
    assert k * stride // page <= MAX_GROUP_PAGES
    assert all(j * stride % page for j in range(1, k))  # no smaller group is whole pages
    assert blocks_per_group([stride], page) == k


def test_whole_page_groups_of_common_models():
    # 8B, block-outermost: 32 layers x 64 KiB = 2 MiB a block; 8 MiB pages hold 4 blocks.
    assert whole_page_blocks(32 * 64 * KIB, 8 * MIB) == 4
    # 28 layers x 16 KiB = 448 KiB a block: 128 blocks make 7 whole 8 MiB pages.
    assert whole_page_blocks(28 * 16 * KIB, 8 * MIB) == 128
    # A block larger than a page: 80 layers x 32 KiB = 2.5 MiB; 16 blocks are 5 pages of 8 MiB.
    assert whole_page_blocks(80 * 32 * KIB, 8 * MIB) == 16
    with pytest.raises(ValueError):
        whole_page_blocks(0, 8 * MIB)


@given(st.lists(st.integers(0, 1 << 20).map(lambda n: n * 256), min_size=1, max_size=6), PAGES,
       st.integers(1, 1 << 16))
@settings(max_examples=200)
def test_block_count_multiple_aligns_every_run_and_is_the_least_that_does(coefficients, page, num_blocks):
    multiple = num_blocks_multiple(coefficients, page)
    rounded = aligned_num_blocks(num_blocks, multiple)
    assert rounded <= num_blocks
    if num_blocks >= multiple:
        assert rounded % multiple == 0 and num_blocks - rounded < multiple
        assert all(c * rounded % page == 0 for c in coefficients)
    else:
        assert rounded == num_blocks  # rounding would leave no block: nothing changes
    aligned_all = all(c * num_blocks % page == 0 for c in coefficients)
    assert aligned_all == (num_blocks % multiple == 0)


def _config(num_blocks, *tensors):
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[
        SimpleNamespace(size=0, layers=["x"] * layers, layer_stride=ls, block_stride=bs, offset=off)
        for layers, ls, bs, off in tensors])


def test_layer_outermost_multiple_reads_kv_cache_tensor_placement():
    page = 64 * KIB
    # Layer-outermost, 16 KiB pages: layer l starts at l * 16 KiB * N, aligned when 4 | N.
    assert layer_outermost_multiple(_config(1000, (3, 16 * KIB * 1000, 16 * KIB, 0)), page) == 4
    # A second spec placed after three 16 KiB layers, with 24 KiB pages: 8 | N.
    config = _config(1000, (3, 16 * KIB * 1000, 16 * KIB, 0), (2, 24 * KIB * 1000, 24 * KIB, 48 * KIB * 1000))
    assert layer_outermost_multiple(config, page) == 8
    # Block-outermost: layers sit inside each block, nothing to round.
    assert layer_outermost_multiple(_config(1000, (3, 16 * KIB, 48 * KIB, 0)), page) is None
    assert layer_outermost_multiple(_config(1000), page) is None
    with pytest.raises(ValueError, match="num_blocks"):
        layer_outermost_multiple(_config(1000, (3, 16 * KIB * 1000 + 8, 16 * KIB, 0)), page)


def test_group_size_of_a_config_follows_its_block_stride():
    assert group_blocks_of_config(_config(1000, (32, 64 * KIB, 2 * MIB, 0)), 8 * MIB) == 4
    assert group_blocks_of_config(_config(1000), 8 * MIB) is None
    # Layer-outermost layers of 16 and 24 KiB pages in one group: whole pages at both strides.
    mixed = _config(1000, (3, 16 * KIB * 1000, 16 * KIB, 0), (2, 24 * KIB * 1000, 24 * KIB, 48 * KIB * 1000))
    assert group_blocks_of_config(mixed, 64 * KIB) == 8  # 8 x 16 KiB = 2 pages, 8 x 24 KiB = 3 pages


@given(st.lists(STRIDES, min_size=1, max_size=3), PAGES)
def test_groups_over_several_strides_are_whole_pages_at_each_or_the_plain_size(strides, page):
    k = blocks_per_group(strides, page)
    whole = all(k * stride % page == 0 for stride in strides) and k * max(strides) // page <= MAX_GROUP_PAGES
    if whole:
        assert all(any(j * stride % page for stride in strides) for j in range(1, k))  # and the least such
    else:
        assert k == max(1, page // min(strides))
    with pytest.raises(ValueError):
        blocks_per_group([], page)


def test_block_outermost_layouts_move_to_the_front_in_their_own_order():
    reported = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
    moved = block_outermost_first(reported, lambda name: name.startswith("B"))
    assert moved == ["BLNHC", "BLHNC", "BHLNC", "LBNHC", "LBHNC", "LHBNC"]
    assert block_outermost_first(["LBHNC"], lambda name: name.startswith("B")) == ["LBHNC"]
