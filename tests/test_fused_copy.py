"""The fused gather's kernel, run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``).

The staged movers (write-through's stores on their own stream, the loads nothing
waits for) gather into their staging rows with this kernel. The interpreter
executes the same kernel source with numpy, reading and writing the raw
addresses of the piece table, so the address arithmetic, the column offsets,
the masks and the piece table are checked byte for byte here (between block
views and plain rows); only the compiled GPU code (16-byte accesses) needs the
GPU tests (``tests/gpu/test_fused_copy_cuda.py``).
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from kvelastic.errors import ConfigError
from kvelastic.offload.block_columns import BlockColumns
from kvelastic.offload.copier import BlockCopier
from kvelastic.offload.fused_copy import FusedCopy, kernel_for
from kvelastic.offload.staged_copy import StagedCopy
from tests.copier_cases import round_trip, strided_views

pytest.importorskip("triton")
KIB = 1024


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def kv_views(layers: int, widths: list[int], strides: list[int], num_blocks: int) -> tuple[list, list]:
    """Per layer one raw tensor per width, each holding that piece of every block at its own row stride
    (so pieces differ in stride, as K and V runs of separate tensors may); returns (raws, views)."""
    raws, views = [], []
    for _ in range(layers):
        for width, stride in zip(widths, strides):
            raw = torch.randint(-128, 127, (num_blocks * stride + 64,), dtype=torch.int8)
            raws.append(raw)
            views.append(torch.as_strided(raw, (num_blocks, width), (stride, 1), 16))
    return raws, views


def block_bytes(views: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([v[block] for v in views])


def fused(views: list[torch.Tensor], rows: torch.Tensor) -> FusedCopy:
    return FusedCopy(BlockColumns.of(views, rows), rows, torch.device("cpu"))


def round_trip_views(views: list[torch.Tensor], raws: list[torch.Tensor], *, seed: int) -> FusedCopy:
    """Store random blocks to shuffled rows, load them into other blocks; compare every byte, gaps included."""
    rng = random.Random(seed)
    num_blocks, slots = views[0].shape[0], 24
    count = min(12, num_blocks // 2)
    host = torch.zeros((slots, sum(v.shape[1] for v in views)), dtype=torch.int8)
    mover = fused(views, host)
    sources, targets = rng.sample(range(num_blocks), count), rng.sample(range(slots), count)
    want = {s: block_bytes(views, s) for s in sources}
    mover.store(sources, targets, _indices)
    for block, slot in zip(sources, targets):
        assert torch.equal(host[slot], want[block]), f"slot {slot} differs from block {block}"
    untouched = [s for s in range(slots) if s not in targets]
    assert not host[untouched].any(), "a slot nobody stored into was written"
    before = [r.clone() for r in raws]
    destinations = rng.sample(range(num_blocks), count)
    mover.load(destinations, targets, _indices)
    for block, source in zip(destinations, sources):
        assert torch.equal(block_bytes(views, block), want[source]), f"block {block} wrong after load"
    for raw, old in zip(raws, before):  # everything outside the loaded blocks' pieces is as it was
        for block in destinations:
            for v in views:
                if v.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
                    offset = v.storage_offset() + block * v.stride(0)
                    old[offset:offset + v.shape[1]] = raw[offset:offset + v.shape[1]]
        assert torch.equal(raw, old), "bytes outside the loaded blocks changed"
    return mover


@pytest.mark.parametrize("layers, widths, strides, align, even", [
    (4, [32 * KIB, 32 * KIB], [32 * KIB, 64 * KIB], 16, True),  # 8B-like runs, K and V at different strides
    (4, [16 * KIB, 16 * KIB], [16 * KIB, 16 * KIB], 16, True),  # 1B-like
    (3, [1000, 24], [1008, 40], 8, False),  # not a multiple of 16 bytes: 8-byte accesses, masked tails
    (2, [5, 3, 7], [5, 11, 9], 1, False),  # odd everything: byte accesses
    (2, [12 * KIB, 4 * KIB], [16 * KIB, 4 * KIB], 16, False),  # aligned pieces of two widths: masks
], ids=["8b-like", "1b-like", "width-1000", "odd", "two-widths"])
def test_interpreted_round_trip_is_exact(interpreted, layers, widths, strides, align, even):
    raws, views = kv_views(layers, widths, strides, num_blocks=40)
    launch = round_trip_views(views, raws, seed=layers + len(widths)).launch
    assert (launch.align, launch.even) == (align, even), launch


@pytest.mark.parametrize("widths", [[4096, 4096], [1000, 24], [5, 3]])
@pytest.mark.parametrize("staging_rows", [1, 7, 1000])
def test_the_shared_copier_cases_pass_through_staged_movers_with_the_fused_gather(interpreted, widths, staging_rows):
    copier = round_trip("cpu", "direct", widths, staging_bytes=staging_rows * sum(widths))
    assert copier._side_mover.fused is not None and copier._async_load_mover.fused is not None


def test_a_large_piece_spans_many_chunks(interpreted):
    """A 2 MiB-wide view (one piece per block, as one tensor per layer would be) over 256 chunks of 8 KiB."""
    raws, views = kv_views(1, [2048 * KIB], [2048 * KIB], num_blocks=6)
    launch = round_trip_views(views, raws, seed=3).launch
    assert (launch.chunks, launch.chunk) == (256, 8 * KIB)


def test_out_of_range_ids_raise_before_anything_is_written(interpreted):
    raws, views = kv_views(1, [64], [64], num_blocks=8)
    host = torch.zeros((4, 64), dtype=torch.int8)
    mover = fused(views, host)
    for blocks, slots in (([8], [0]), ([0], [4]), ([-1], [0]), ([0, 1], [0])):
        with pytest.raises((IndexError, ValueError)):
            mover.store(blocks, slots, _indices)
    assert not host.any()


def test_fused_refuses_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="the fused gather needs a CUDA device"):
        fused([torch.zeros((4, 64), dtype=torch.int8)], torch.zeros((4, 64), dtype=torch.int8))


def test_fused_refuses_the_interpreter_on_a_gpu(interpreted):
    """The interpreter dereferences addresses on the host: GPU addresses there would crash or read garbage."""
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1 runs kernels on the host"):
        kernel_for(torch.device("cuda", 0))


def test_fused_without_triton_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with pytest.raises(ConfigError, match="the fused gather needs triton"):
        kernel_for(torch.device("cuda", 0))


def test_fused_is_no_path_of_the_copier_itself():
    with pytest.raises(ValueError, match="unknown copy path 'fused'"):
        BlockCopier([torch.zeros((4, 64), dtype=torch.int8)], torch.zeros((4, 64), dtype=torch.int8), path="fused")


def test_views_with_strided_rows_are_refused(interpreted):
    raw = torch.zeros(4 * 128, dtype=torch.int8)
    view = torch.as_strided(raw, (4, 64), (128, 2))
    with pytest.raises(ConfigError, match="rows of contiguous bytes"):
        fused([view], torch.zeros((4, 64), dtype=torch.int8))


def test_strided_views_of_the_shared_cases_are_what_the_kernel_sees(interpreted):
    """Views cut from one raw tensor (as the engine's are) at a stride not a multiple of 16."""
    raw = torch.randint(-128, 127, (16 * 200,), dtype=torch.int8)
    views = strided_views(raw, 16, [96, 80], 200)
    round_trip_views(views, [raw], seed=5)


@pytest.mark.parametrize("align, even, access", [(16, True, "v4.b32"), (16, False, "v4.b32"), (8, False, "v2.b32")])
@pytest.mark.parametrize("to_host", [True, False])
def test_the_kernel_compiles_to_wide_accesses_for_an_h100(monkeypatch, align, even, access, to_host):
    """Compiled for sm_90 here, no GPU needed: the alignment hints must reach the loads and stores
    (on integers cast to pointers Triton loses them: the pointers carry them instead)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvelastic.offload.fused_kernel import jitted

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    aligned = [["tt.divisibility", 16]]
    try:  # this form since triton 3.3; older releases (other test venvs) take other arguments
        source = ASTSource(fn=jitted(), signature={"table": "*i64", "blocks": "*i64", "rows": "*i64", "host": "i64",
                                                   "host_stride": "i32", "TO_HOST": "constexpr", "ALIGN": "constexpr",
                                                   "BLOCK": "constexpr", "EVEN": "constexpr"},
                           constexprs={"TO_HOST": to_host, "ALIGN": align, "BLOCK": 8192, "EVEN": even},
                           attrs={(i,): aligned for i in range(5)})
    except TypeError as e:
        pytest.skip(f"triton {triton.__version__}'s ASTSource takes other arguments: {e}")
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    moves = set(re.findall(r"(?:ld|st)\.global\.(\S+?) ", ptx))
    assert {"b64", access} == moves, f"expected {access} accesses (b64: the table and indices), got {moves}"


def test_a_staged_copy_with_a_fused_gather_is_exact_across_chunks(interpreted):
    """A staged mover: one fused kernel gathers a chunk into the staging rows
    (and scatters it back), five rows a chunk here, so a batch of twelve takes three chunks each way."""
    raws, views = kv_views(3, [1000, 24], [1008, 40], num_blocks=40)
    host = torch.zeros((24, sum(v.shape[1] for v in views)), dtype=torch.int8)
    columns = BlockColumns.of(views, host)
    mover = StagedCopy(columns, host, torch.device("cpu"), 5 * columns.row_bytes, fused=True)
    assert mover.fused is not None and mover.rows_per_chunk == 5
    rng = random.Random(5)
    sources, slots = rng.sample(range(40), 12), rng.sample(range(24), 12)
    want = {s: block_bytes(views, s).clone() for s in sources}
    mover.store(sources, slots, _indices)
    for block, slot in zip(sources, slots):
        assert torch.equal(host[slot], want[block])
    destinations = rng.sample([b for b in range(40) if b not in sources], 12)
    mover.load(destinations, slots, _indices)
    for block, source in zip(destinations, sources):
        assert torch.equal(block_bytes(views, block), want[source])


def test_side_stores_gather_with_one_kernel_where_triton_runs(interpreted):
    raws, views = kv_views(2, [4096, 4096], [4096, 4096], num_blocks=8)
    host = torch.zeros((8, 4 * 4096), dtype=torch.int8)
    copier = BlockCopier(views, host, path="direct", staged_side_stores=True)
    assert copier._side_mover.fused is not None
    copier.store_beside([3, 6], [1, 0]).wait()
    assert torch.equal(host[1], block_bytes(views, 3)) and torch.equal(host[0], block_bytes(views, 6))


def test_side_stores_gather_piece_by_piece_where_triton_cannot_run_and_say_so(monkeypatch, kv_log):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU without the interpreter: no kernel
    raws, views = kv_views(2, [4096, 4096], [4096, 4096], num_blocks=8)
    copier = BlockCopier(views, torch.zeros((8, 4 * 4096), dtype=torch.int8), staged_side_stores=True, path="direct")
    assert copier._side_mover.fused is None
    assert any("the staged side store copies move piece by piece" in r.message for r in kv_log.records)


def _indices(values):
    return torch.tensor(list(values), dtype=torch.int64)
