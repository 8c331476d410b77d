"""Where each piece of a KV block sits in a host row, in the widest element type that fits.

A block is one run of bytes in each of several views (a layer's K run, its V
run, ...). A host row lays those pieces side by side. Both copy paths move the
pieces with gather and scatter kernels, and a kernel moves one element per
thread: int64 elements move eight times the bytes per instruction of int8 ones,
which matters most when the kernel reads or writes host memory over PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

_WIDEST_FIRST = (torch.int64, torch.int32, torch.int16, torch.int8)


def _fits(tensor: torch.Tensor, size: int) -> bool:
    return (tensor.stride(-1) == 1 and tensor.shape[-1] % size == 0 and tensor.storage_offset() % size == 0
            and all(s % size == 0 for s in tensor.stride()[:-1]) and tensor.data_ptr() % size == 0)


def widest_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest integer type every int8 tensor can be viewed as (int8 itself at worst)."""
    for dtype in _WIDEST_FIRST:
        size = torch.empty((), dtype=dtype).element_size()
        if all(_fits(t, size) for t in tensors):
            return dtype
    return torch.int8


@dataclass(frozen=True)
class BlockColumns:
    """The block views, viewed as ``dtype``, and each one's column span in a host row."""

    views: tuple[torch.Tensor, ...]
    spans: tuple[tuple[int, int], ...]
    dtype: torch.dtype
    row_bytes: int

    @classmethod
    def of(cls, block_views: Sequence[torch.Tensor], host: torch.Tensor) -> "BlockColumns":
        """Columns for ``block_views`` (each (num_blocks, bytes), int8) in the rows of ``host``."""
        widths = [v.shape[1] for v in block_views]
        if sum(widths) != host.shape[1]:
            raise ValueError(f"host slots hold {host.shape[1]} bytes, blocks have {sum(widths)}")
        dtype = widest_dtype([*block_views, host])
        size = torch.empty((), dtype=dtype).element_size()
        spans, offset = [], 0
        for width in widths:
            spans.append((offset // size, (offset + width) // size))
            offset += width
        return cls(tuple(v.view(dtype) for v in block_views), tuple(spans), dtype, host.shape[1])

    def rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """An int8 (n, row_bytes) buffer viewed in this layout's element type."""
        return buffer.view(self.dtype)

    def pieces(self) -> list[tuple[torch.Tensor, int, int]]:
        return [(view, c0, c1) for view, (c0, c1) in zip(self.views, self.spans)]


def check_range(values: Sequence[int], limit: int, what: str) -> None:
    """Refuse ids outside ``0..limit-1`` before a copy that writes through raw addresses
    (a kernel or a 2D transfer would corrupt memory, not raise)."""
    if values and not (0 <= min(values) and max(values) < limit):
        raise IndexError(f"{what}s {min(values)}..{max(values)} outside 0..{limit - 1}")
