"""The block copier's movers (its own, and the staged ones of the copies beside compute), its column
layout and its slot runs, on the CPU."""

from __future__ import annotations

import pytest
import torch

from kvelastic.offload.block_columns import BlockColumns, widest_dtype
from kvelastic.offload.host_tier import HostTier
from kvelastic.offload.staged_copy import slot_runs
from tests.copier_cases import round_trip


@pytest.mark.parametrize("widths", [[64, 64, 128], [12, 20], [5, 3]], ids=["int64", "int32", "int8"])
def test_round_trip_is_exact(widths):
    copier = round_trip("cpu", "direct", widths)
    assert copier.path == "direct" and copier._side_mover is None and copier._async_load_mover is None


@pytest.mark.parametrize("widths", [[64, 64, 128], [12, 20], [5, 3]], ids=["int64", "int32", "int8"])
@pytest.mark.parametrize("staging_rows", [1, 7, 1000])
def test_the_staged_movers_round_trip_exactly_chunk_by_chunk(widths, staging_rows):
    """Write-through's stores on their own stream and the loads nothing waits for, each through a staging
    buffer of its own, one row, seven rows or the whole batch at a time."""
    copier = round_trip("cpu", "direct", widths, staging_bytes=staging_rows * sum(widths))
    for mover in (copier._side_mover, copier._async_load_mover):
        assert mover is not None and mover.rows_per_chunk == min(staging_rows, 48)


def test_widest_dtype_follows_widths_and_offsets():
    raw = torch.zeros(1024, dtype=torch.int8)
    assert widest_dtype([raw.view(16, 64)]) == torch.int64
    assert widest_dtype([raw.view(16, 64), raw[4:68].view(1, 64)]) == torch.int32
    assert widest_dtype([raw.view(128, 8)[:, :6]]) == torch.int16
    assert widest_dtype([raw.view(16, 64), raw[:63].view(9, 7)]) == torch.int8


def test_columns_reject_rows_of_the_wrong_width():
    views = [torch.zeros((4, 8), dtype=torch.int8)]
    with pytest.raises(ValueError, match="host slots hold 12 bytes, blocks have 8"):
        BlockColumns.of(views, torch.zeros((2, 12), dtype=torch.int8))


def test_unknown_path_is_refused():
    from kvelastic.offload.copier import BlockCopier

    with pytest.raises(ValueError, match="unknown copy path 'dma'"):
        BlockCopier([torch.zeros((4, 8), dtype=torch.int8)], torch.zeros((2, 8), dtype=torch.int8), path="dma")


def test_auto_takes_the_copy_engines_only_for_wide_pieces_on_cuda():
    from kvelastic.offload.copier import RUNS_MIN_PIECE_BYTES, auto_path

    wide, narrow = RUNS_MIN_PIECE_BYTES, RUNS_MIN_PIECE_BYTES // 2
    assert auto_path([wide, wide], on_cuda=True) == "runs"  # 8B: 32 KiB K and V runs
    assert auto_path([wide, narrow], on_cuda=True) == "direct"  # 1B (16 KiB), or a TP=2 shard of 8B
    assert auto_path([wide, wide], on_cuda=False) == "direct"


def test_auto_is_direct_on_a_cpu_and_says_so(kv_log):
    copier = round_trip("cpu", "auto", [64 * 1024, 48 * 1024])
    assert copier.path == "direct"
    assert "host-tier copies run on GPU kernels (narrowest piece of a block 48.00 KiB)" in kv_log.text


def test_a_named_path_is_not_announced(kv_log):
    round_trip("cpu", "direct", [64, 64])
    assert "host-tier copies run on" not in kv_log.text


def test_slot_runs():
    assert list(slot_runs([])) == []
    assert list(slot_runs([3])) == [(0, 3, 1)]
    assert list(slot_runs([0, 1, 2, 5, 6, 9])) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]


def test_host_tier_hands_out_lowest_free_slots_first():
    tier = HostTier(8 * 64, 64, pin=False, policy="lru")
    assert [tier.admit(k) for k in "abcd"] == [0, 1, 2, 3]
    for key in "efghij":  # full after h; i and j evict a and b, the oldest
        tier.admit(key)
    assert tier.lookup("i") == 0 and tier.lookup("j") == 1
