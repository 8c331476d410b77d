"""One Triton kernel per batch that moves every piece of every block between block views and rows.

The staged copies (``staged_copy``) gather a chunk of blocks into their
staging rows, and scatter it back, with it: a pair of kernels per block piece
would cost the thread that issues the copies 128 launches per chunk of an 8B
batch. One launch per chunk and direction reads each piece straight from its
source and writes it straight to its target, 16 bytes per access where the
layout allows. The kernel finds the pieces in a small device table of
addresses, strides and row columns built once, at setup (``fused_kernel``).
Its rows may be any rows the device can address (the staging buffer; pinned
host rows through unified addressing).

Triton is imported only when a staged mover is built. A machine that cannot
run the kernel (no triton, no CUDA device, or the interpreter asked for GPU
memory) is refused at setup with a :class:`ConfigError`, and the staged mover
then gathers piece by piece: never a wrong copy later.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvelastic.errors import ConfigError
from kvelastic.offload.block_columns import BlockColumns, check_range

Indices = Callable[[Sequence[int]], torch.Tensor]
#: Bytes one program copies of one piece: 8 KiB is 4 accesses of 16 bytes for each of 128 threads,
#: enough in flight to keep the link busy.
CHUNK_BYTES = 8192
NUM_WARPS = 4
WIDEST_ACCESS = 16  # bytes: the widest load or store a GPU thread issues
_REFUSED = "the fused gather"


@functools.lru_cache(maxsize=2)
def _jitted(interpret: bool) -> Any:
    """One kernel object per mode, so every copier shares its compiled variants."""
    from kvelastic.offload import fused_kernel

    return fused_kernel.jitted()


def kernel_for(device: torch.device) -> Any:
    """The kernel that can reach ``device``'s memory, or a :class:`ConfigError` saying why none can."""
    try:
        import triton
    except ImportError as e:
        raise ConfigError(f"{_REFUSED} needs triton, which cannot be imported here ({e})") from None
    interpret = _interpreting(triton)
    if device.type == "cuda" and interpret:
        raise ConfigError(f"{_REFUSED}: TRITON_INTERPRET=1 runs kernels on the host, which cannot reach "
                          f"the blocks on {device}; unset TRITON_INTERPRET")
    if device.type != "cuda" and not interpret:
        raise ConfigError(f"{_REFUSED} needs a CUDA device, and the blocks are on {device} "
                          f"(TRITON_INTERPRET=1 runs it there in tests)")
    return _jitted(interpret)


def _interpreting(triton: Any) -> bool:
    """Whether ``triton.jit`` makes interpreted kernels now (``knobs`` since triton 3.3; before, the variable)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class Launch:
    """How the batch is cut into programs: ``chunk`` bytes each, ``chunks`` per piece, ``align`` bytes per access."""

    chunk: int
    chunks: int
    align: int
    even: bool  # every piece is ``chunks`` whole chunks: no masks

    @classmethod
    def of(cls, widths: Sequence[int], aligned: Sequence[int], chunk_bytes: int) -> "Launch":
        """``aligned``: every address, stride and column the kernel adds up (their alignment is the access width)."""
        if chunk_bytes < WIDEST_ACCESS or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a power of two of at least {WIDEST_ACCESS}")
        widest = max(widths)
        chunk = min(chunk_bytes, 1 << (widest - 1).bit_length())  # a power of two (tl.arange), no wider than needed
        align = math.gcd(WIDEST_ACCESS, *widths, *aligned)
        even = len(set(widths)) == 1 and widest % chunk == 0
        return cls(chunk, -(-widest // chunk), align, even)


class FusedCopy:
    """One kernel launch per batch and direction between the block views and rows the device can address."""

    def __init__(self, columns: BlockColumns, host: torch.Tensor, device: torch.device, *,
                 chunk_bytes: int = CHUNK_BYTES, num_warps: int = NUM_WARPS):
        self.kernel = kernel_for(device)
        self.views = columns.views  # the table holds their addresses: keep them alive
        self.host = host
        size = columns.views[0].element_size()
        table, aligned = _piece_table(columns, size)
        aligned += [host.data_ptr(), host.stride(0) * host.element_size()]
        _check_rows(host, "the host buffer")
        self.launch = Launch.of([row[3] for row in table], aligned, chunk_bytes)
        self.table = torch.tensor(table, dtype=torch.int64, device=device)
        self.num_warps = num_warps
        self.num_blocks = min(v.shape[0] for v in columns.views)
        self._compile_both(device)

    def store(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices) -> None:
        self._copy(block_ids, slots, indices, to_host=True)

    def load(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices) -> None:
        self._copy(block_ids, slots, indices, to_host=False)

    def _copy(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices, *, to_host: bool) -> None:
        # The kernel writes through raw addresses: an id out of range would corrupt memory, not raise.
        check_range(block_ids, self.num_blocks, "block id")
        check_range(slots, self.host.shape[0], "host slot")
        if len(block_ids) != len(slots):
            raise ValueError(f"{len(block_ids)} blocks but {len(slots)} host slots")
        self._launch(indices(block_ids), indices(slots), len(block_ids), to_host)

    def _launch(self, blocks: torch.Tensor, rows: torch.Tensor, count: int, to_host: bool) -> None:
        grid = (count, self.table.shape[0], self.launch.chunks)
        host_stride = self.host.stride(0) * self.host.element_size()
        self.kernel[grid](self.table, blocks, rows, self.host.data_ptr(), host_stride, TO_HOST=to_host,
                          ALIGN=self.launch.align, BLOCK=self.launch.chunk, EVEN=self.launch.even,
                          num_warps=self.num_warps)

    def _compile_both(self, device: torch.device) -> None:
        """Compile both directions now (an empty grid runs nothing): a kernel that cannot build stops setup.

        Triton compiles for the current device, so it is made ``device`` here (the copies run under the
        copy stream's context, which does the same)."""
        one = torch.zeros(1, dtype=torch.int64, device=device)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for to_host in (True, False):
                self._launch(one, one, 0, to_host)


def _piece_table(columns: BlockColumns, size: int) -> tuple[list[list[int]], list[int]]:
    """One row per piece, in bytes: view address, view row stride, column in a host row, width."""
    table, aligned = [], []
    for view, c0, c1 in columns.pieces():
        _check_rows(view, "a block view")
        row = [view.data_ptr(), view.stride(0) * size, c0 * size, (c1 - c0) * size]
        table.append(row)
        aligned += row[:3]
    return table, aligned


def _check_rows(tensor: torch.Tensor, what: str) -> None:
    if tensor.dim() != 2 or (tensor.shape[1] > 1 and tensor.stride(1) != 1):
        raise ConfigError(f"{_REFUSED} copies rows of contiguous bytes, and {what} has shape "
                          f"{tuple(tensor.shape)}, strides {tensor.stride()}")
