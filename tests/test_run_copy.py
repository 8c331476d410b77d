"""The runs copy path on the CPU: the split into runs, and the copies themselves.

The split is pure logic (every block once, runs maximal, thresholds, breaks, order). The copies
run twice over: with tensor slice copies (the CPU stand-in the copier uses on the host backend),
and through :class:`DriverTransfers` with a fake driver whose ``cuMemcpy2DAsync`` really moves the
bytes row by row at the addresses it is given, so the address and pitch arithmetic is checked
byte for byte against the direct path; only the copy engines themselves need the GPU tests
(``tests/gpu/test_run_copy_cuda.py``).
"""

from __future__ import annotations

import ctypes
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvelastic.errors import ConfigError, DriverError
from kvelastic.offload.block_columns import BlockColumns
from kvelastic.offload.direct_copy import DirectCopy
from kvelastic.offload.run_copy import (MIN_RUN_BLOCKS, DriverTransfers, Piece, Run, RunCopy, SliceTransfers,
                                        driver_transfers, pieces_of, split_runs)
from tests.copier_cases import strided_views


def cpu_indices(values):
    return torch.tensor(list(values), dtype=torch.int64)


def pairs_of(split, block_ids, slots):
    """Every (block, slot) pair the split moves, runs expanded."""
    moved = [(run.block + k, run.slot + k) for run in split.runs for k in range(run.count)]
    return moved + [(block_ids[i], slots[i]) for i in split.rest]


# -- the split ----------------------------------------------------------------------------------------------


def test_an_empty_batch_has_no_runs_and_no_rest():
    assert split_runs([], []) == split_runs([], [], min_blocks=1)
    assert split_runs([], []).runs == () and split_runs([], []).rest == ()


def test_one_long_run_goes_out_whole():
    split = split_runs(list(range(100, 164)), list(range(7, 71)))
    assert split.runs == (Run(100, 7, 64),) and split.rest == () and split.run_blocks() == 64


def test_the_threshold_is_inclusive():
    assert split_runs(list(range(5)), list(range(10, 15)), min_blocks=5).runs == (Run(0, 10, 5),)
    short = split_runs(list(range(4)), list(range(10, 14)), min_blocks=5)
    assert short.runs == () and short.rest == (0, 1, 2, 3)
    assert split_runs([3], [8], min_blocks=1).runs == (Run(3, 8, 1),)


def test_both_ids_and_slots_must_go_up_by_one():
    assert split_runs(list(range(8)), [0, 2, 4, 6, 8, 10, 12, 14], min_blocks=2).runs == ()  # slots step 2
    assert split_runs([0, 2, 4, 6], [0, 1, 2, 3], min_blocks=2).runs == ()  # ids step 2
    assert split_runs([3, 2, 1, 0], [0, 1, 2, 3], min_blocks=2).runs == ()  # ids go down
    assert split_runs([5, 6, 9, 10, 11], [0, 1, 2, 3, 4], min_blocks=2).runs == (Run(5, 0, 2), Run(9, 2, 3))


def test_runs_are_found_in_any_batch_order_and_reported_in_slot_order():
    block_ids, slots = [40, 41, 42, 43, 10, 11, 12], [20, 21, 22, 23, 3, 4, 5]
    order = [6, 2, 0, 4, 3, 5, 1]
    split = split_runs([block_ids[i] for i in order], [slots[i] for i in order], min_blocks=3)
    assert split.runs == (Run(10, 3, 3), Run(40, 20, 4)) and split.rest == ()


def test_the_rest_keeps_the_batch_order():
    block_ids = [9, 0, 1, 2, 3, 50, 7, 30]
    slots = [100, 10, 11, 12, 13, 1, 60, 2]
    split = split_runs(block_ids, slots, min_blocks=4)
    assert split.runs == (Run(0, 10, 4),)
    assert split.rest == (0, 5, 6, 7)


def test_a_break_starts_a_new_run():
    split = split_runs(list(range(40)), list(range(40)), min_blocks=16, breaks={24})
    assert split.runs == (Run(0, 0, 24), Run(24, 24, 16))
    cut = split_runs(list(range(40)), list(range(40)), min_blocks=16, breaks={10, 30})
    assert cut.runs == (Run(10, 10, 20),) and cut.rest == tuple(range(10)) + tuple(range(30, 40))


def test_a_duplicate_pair_never_extends_a_run():
    split = split_runs([0, 1, 1, 2], [0, 1, 1, 2], min_blocks=2)
    assert Counter(pairs_of(split, [0, 1, 1, 2], [0, 1, 1, 2])) == Counter([(0, 0), (1, 1), (1, 1), (2, 2)])


def test_the_default_threshold_is_sixteen_blocks():
    assert MIN_RUN_BLOCKS == 16
    assert split_runs(list(range(16)), list(range(16))).runs == (Run(0, 0, 16),)
    assert split_runs(list(range(15)), list(range(15))).runs == ()


def test_bad_batches_are_refused():
    with pytest.raises(ValueError, match="3 blocks but 2 host slots"):
        split_runs([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 1"):
        split_runs([1], [1], min_blocks=0)


def chains(block_ids, slots, breaks):
    """Reference: the maximal chains of a batch with distinct slots, walked from each chain's head."""
    by_slot = dict(zip(slots, block_ids))
    found = []
    for slot, block in by_slot.items():
        if by_slot.get(slot - 1) == block - 1 and slot not in breaks:
            continue  # not a head
        count = 1
        while by_slot.get(slot + count) == block + count and slot + count not in breaks:
            count += 1
        found.append(Run(block, slot, count))
    return found


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_block_once_and_every_long_chain_a_run(data):
    n = data.draw(st.integers(0, 80))
    slots = data.draw(st.permutations(range(120)))[:n] if data.draw(st.booleans()) else \
        sorted(data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n, unique=True)))
    shift = data.draw(st.integers(0, 50))
    block_ids = [s + shift if data.draw(st.integers(0, 9)) else data.draw(st.integers(0, 300)) for s in slots]
    breaks = set(data.draw(st.lists(st.integers(0, 200), max_size=4)))
    min_blocks = data.draw(st.integers(1, 20))
    split = split_runs(block_ids, slots, min_blocks=min_blocks, breaks=breaks)
    assert Counter(pairs_of(split, block_ids, slots)) == Counter(zip(block_ids, slots))
    assert list(split.rest) == sorted(set(split.rest))
    assert [r.slot for r in split.runs] == sorted(r.slot for r in split.runs)
    if len(set(slots)) == len(slots):
        want = sorted((r for r in chains(block_ids, slots, breaks) if r.count >= min_blocks), key=lambda r: r.slot)
        assert list(split.runs) == want


# -- the pieces ---------------------------------------------------------------------------------------------


def test_pieces_give_each_views_address_pitch_and_host_column_in_bytes():
    raw = torch.zeros(8 * 96, dtype=torch.int8)
    views = strided_views(raw, 8, [64, 16], 96)
    pieces = pieces_of(BlockColumns.of(views, torch.zeros((4, 80), dtype=torch.int8)))
    assert pieces == [Piece(raw.data_ptr(), 96, 0, 64), Piece(raw.data_ptr() + 64, 96, 64, 16)]


def test_views_whose_rows_are_not_contiguous_bytes_are_refused():
    raw = torch.zeros(64, dtype=torch.int8)
    scattered = torch.as_strided(raw, (4, 8), (1, 4))
    with pytest.raises(ConfigError, match="rows of contiguous bytes"):
        pieces_of(BlockColumns.of([scattered], torch.zeros((2, 8), dtype=torch.int8)))


# -- the copies -------------------------------------------------------------------------------------------


class MovingDriver:
    """A fake ``cuda.bindings.driver`` whose 2D copy moves CPU bytes at the given addresses, row by row."""

    CUmemorytype = SimpleNamespace(CU_MEMORYTYPE_HOST="host", CU_MEMORYTYPE_DEVICE="device")

    def __init__(self, fail_at: int | None = None):
        self.calls: list[dict] = []
        self.fail_at = fail_at

    @staticmethod
    def CUDA_MEMCPY2D():  # noqa: N802 (the driver's name)
        return SimpleNamespace()

    def cuMemcpy2DAsync(self, c, stream):  # noqa: N802
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            return (FakeError(700),)
        self.calls.append({**vars(c), "stream": stream})
        src = c.srcDevice if c.srcMemoryType == "device" else c.srcHost
        dst = c.dstDevice if c.dstMemoryType == "device" else c.dstHost
        for row in range(c.Height):
            ctypes.memmove(dst + row * c.dstPitch, src + row * c.srcPitch, c.WidthInBytes)
        return (0,)


class FakeError(int):
    name = "CUDA_ERROR_ILLEGAL_ADDRESS"


def kv(layers=3, widths=(64, 40), stride=120, num_blocks=96, seed=0):
    """Per layer a raw tensor of ``num_blocks`` rows of ``stride`` bytes holding each width side by side."""
    torch.manual_seed(seed)
    raws = [torch.randint(-128, 127, (num_blocks * stride,), dtype=torch.int8) for _ in range(layers)]
    return raws, [v for r in raws for v in strided_views(r, num_blocks, list(widths), stride)]


def run_copy(views, host, transfers: str, driver=None, **kwargs) -> RunCopy:
    columns = BlockColumns.of(views, host)
    if transfers == "driver":
        moving = DriverTransfers(pieces_of(columns), host.data_ptr(), host.stride(0), driver=driver or MovingDriver(),
                                 stream=lambda: 7, max_pitch=1 << 31)
        return RunCopy(columns, host, torch.device("cpu"), transfers=moving, **kwargs)
    return RunCopy(columns, host, torch.device("cpu"), **kwargs)


def mixed_batch(rng: random.Random, num_blocks: int, capacity: int) -> tuple[list[int], list[int]]:
    """Shuffled: blocks 10-29 to slots 24-43 (across the break at 40: a run of 16 and 4 left over),
    blocks 60-77 to slots 0-17 (a run of 18), blocks 82-86 to slots 50-54 (too short), 9 scattered."""
    pairs = list(zip(range(10, 30), range(24, 44))) + list(zip(range(60, 78), range(0, 18)))
    pairs += list(zip(range(82, 87), range(50, 55)))
    used_blocks, used_slots = {b for b, _ in pairs}, {s for _, s in pairs}
    blocks = rng.sample([b for b in range(num_blocks) if b not in used_blocks], 9)
    slots = rng.sample([s for s in range(capacity) if s not in used_slots], 9)
    pairs += list(zip(blocks, slots))
    rng.shuffle(pairs)
    return [p[0] for p in pairs], [p[1] for p in pairs]


@pytest.mark.parametrize("transfers", ["slices", "driver"])
@pytest.mark.parametrize("widths", [(64, 40), (5, 3)], ids=["int64", "int8"])
def test_a_mixed_round_trip_moves_the_same_bytes_as_direct(transfers, widths):
    raws, views = kv(widths=widths, stride=sum(widths) + 16)
    hosts = {p: torch.zeros((80, len(views) // 2 * sum(widths)), dtype=torch.int8) for p in ("direct", "runs")}
    runs = run_copy(views, hosts["runs"], transfers, breaks={40})
    direct = DirectCopy(BlockColumns.of(views, hosts["direct"]), hosts["direct"], torch.device("cpu"))
    block_ids, slots = mixed_batch(random.Random(1), 96, 80)
    before = [r.clone() for r in raws]
    runs.store(block_ids, slots, cpu_indices)
    direct.store(block_ids, slots, cpu_indices)
    assert torch.equal(hosts["runs"], hosts["direct"]) and hosts["runs"].any()
    assert runs.moved == {"runs": 16 + 18, "direct": 4 + 5 + 9}
    assert all(torch.equal(a, b) for a, b in zip(raws, before)), "a store wrote to the blocks"
    loaded = {}
    for name, copier in (("runs", runs), ("direct", direct)):
        for r in raws:
            r.zero_()
        copier.load(block_ids, slots, cpu_indices)
        loaded[name] = [r.clone() for r in raws]
    assert all(torch.equal(a, b) for a, b in zip(loaded["runs"], loaded["direct"]))
    assert runs.moved == {"runs": 2 * 34, "direct": 2 * 18}
    wanted = set(block_ids)
    for got, old in zip(loaded["runs"], before):
        rows, old_rows = got.view(96, -1), old.view(96, -1)
        for block in range(96):
            want = old_rows[block].clone() if block in wanted else torch.zeros_like(rows[block])
            want[sum(widths):] = 0  # the bytes between a block's pieces and the next block are never written
            assert torch.equal(rows[block], want), f"block {block}"


def test_the_driver_is_asked_for_one_strided_transfer_per_piece_per_run():
    raws, views = kv(layers=2, widths=(64, 32), stride=128, num_blocks=64)
    host = torch.zeros((48, 2 * 96), dtype=torch.int8)
    driver = MovingDriver()
    copy = run_copy(views, host, "driver", driver=driver, min_blocks=4)
    copy.store([8, 9, 10, 11, 12, 3], [20, 21, 22, 23, 24, 0], cpu_indices)  # a run of 5, one left over
    assert len(driver.calls) == 4 and {c["stream"] for c in driver.calls} == {7}
    first = driver.calls[0]
    assert (first["srcMemoryType"], first["dstMemoryType"]) == ("device", "host")
    assert (first["srcDevice"], first["srcPitch"]) == (views[0].data_ptr() + 8 * 128, 128)
    assert (first["dstHost"], first["dstPitch"]) == (host.data_ptr() + 20 * 192, 192)
    assert (first["WidthInBytes"], first["Height"]) == (64, 5)
    assert driver.calls[1]["srcDevice"] == views[1].data_ptr() + 8 * 128
    assert driver.calls[1]["dstHost"] == host.data_ptr() + 20 * 192 + 64
    assert [c["WidthInBytes"] for c in driver.calls] == [64, 32, 64, 32]
    driver.calls.clear()
    copy.load(list(range(40, 45)), list(range(20, 25)), cpu_indices)
    last = driver.calls[-1]
    assert (last["srcMemoryType"], last["dstMemoryType"]) == ("host", "device")
    assert (last["srcHost"], last["srcPitch"]) == (host.data_ptr() + 20 * 192 + 2 * 64 + 32, 192)
    assert (last["dstDevice"], last["dstPitch"], last["Height"]) == (views[3].data_ptr() + 40 * 128, 128, 5)
    rows = raws[0].view(64, 128)
    assert torch.equal(rows[40:45, :96], rows[8:13, :96])  # the pieces came back; the gap is not copied


def test_a_refused_transfer_raises_a_driver_error_saying_the_batch_is_incomplete():
    _, views = kv(layers=1, widths=(32, 32), stride=64, num_blocks=64)
    host = torch.zeros((64, 64), dtype=torch.int8)
    driver = MovingDriver(fail_at=3)
    copy = run_copy(views, host, "driver", driver=driver, min_blocks=2)
    with pytest.raises(DriverError, match="3 of the batch's 4 transfers were queued") as caught:
        copy.store([0, 1, 2, 10, 11], [0, 1, 2, 5, 6], cpu_indices)
    assert caught.value.call == "cuMemcpy2DAsync" and len(driver.calls) == 3
    assert copy.moved == {"runs": 0, "direct": 0}


def test_ids_out_of_range_are_refused_before_any_copy():
    _, views = kv(layers=1, widths=(32, 32), stride=64, num_blocks=64)
    host = torch.zeros((32, 64), dtype=torch.int8)
    driver = MovingDriver()
    copy = run_copy(views, host, "driver", driver=driver, min_blocks=2)
    with pytest.raises(IndexError, match="block ids 0..64 outside 0..63"):
        copy.load([0, 1, 2, 64], [0, 1, 2, 9], cpu_indices)
    with pytest.raises(IndexError, match="host slots 30..32 outside 0..31"):
        copy.store([0, 1, 2], [30, 31, 32], cpu_indices)
    with pytest.raises(IndexError, match="host slots -1..1"):
        copy.store([5, 6, 7], [-1, 0, 1], cpu_indices)
    assert driver.calls == [] and not host.any()


def test_a_pitch_beyond_the_devices_limit_is_refused_at_setup():
    _, views = kv(layers=1, widths=(32, 32), stride=64, num_blocks=8)
    host = torch.zeros((8, 64), dtype=torch.int8)
    pieces = pieces_of(BlockColumns.of(views, host))
    with pytest.raises(ConfigError, match="largest 2D copy pitch"):
        DriverTransfers(pieces, host.data_ptr(), 64, driver=MovingDriver(), stream=lambda: 0, max_pitch=63)


def test_the_copy_engine_transfers_refuse_blocks_off_a_cuda_device():
    _, views = kv(layers=1, widths=(32, 32), stride=64, num_blocks=8)
    host = torch.zeros((8, 64), dtype=torch.int8)
    with pytest.raises(ConfigError, match="copy engines, and the blocks are on cpu"):
        driver_transfers(BlockColumns.of(views, host), host)


def test_on_a_cpu_the_runs_move_as_slices():
    _, views = kv(layers=1, widths=(32, 32), stride=64, num_blocks=8)
    host = torch.zeros((8, 64), dtype=torch.int8)
    assert isinstance(RunCopy(BlockColumns.of(views, host), host, torch.device("cpu")).transfers, SliceTransfers)


# -- through the copier ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("widths", [[64, 64, 128], [12, 20], [5, 3]], ids=["int64", "int32", "int8"])
def test_the_copiers_runs_path_round_trips_scattered_blocks(widths):
    from tests.copier_cases import round_trip

    copier = round_trip("cpu", "runs", widths)
    assert isinstance(copier.mover, RunCopy) and copier.mover.moved["runs"] == 0  # random blocks make no runs


def test_the_copiers_runs_path_moves_long_runs_and_leaves_the_rest_to_direct():
    from kvelastic.offload.copier import BlockCopier

    raws, views = kv(layers=2, widths=(64, 40), stride=120, num_blocks=96)
    host = torch.zeros((80, 2 * 104), dtype=torch.int8)
    copier = BlockCopier(views, host, path="runs", breaks=frozenset({40}))
    block_ids, slots = mixed_batch(random.Random(3), 96, 80)
    copier.store(block_ids, slots).wait()
    for block, slot in zip(block_ids, slots):
        assert torch.equal(host[slot], torch.cat([v[block] for v in views]))
    assert copier.mover.moved == {"runs": 34, "direct": 18}
    back = [b + 1 if b < 95 else 0 for b in range(96)]
    targets = [back[b] for b in block_ids]
    want = {t: host[s].clone() for t, s in zip(targets, slots)}
    copier.load(targets, slots).wait()
    for target, row in want.items():
        assert torch.equal(torch.cat([v[target] for v in views]), row), f"block {target}"


def test_a_reclaimed_prefix_comes_back_through_the_runs_path(monkeypatch):
    """As the patch wires the tier, with the choice a GPU makes for wide pieces (runs) taken on the CPU."""
    pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")
    from kvelastic.offload import copier as copier_module
    from tests import test_offload

    monkeypatch.setattr(copier_module, "auto_path", lambda pieces, on_cuda: "runs")
    test_offload.reclaimed_prefix_comes_back("arc", "runs")
