"""Block copies by GPU kernels that read and write mapped host memory directly.

Pinned host memory is addressable from the GPU, so one gather kernel per block
piece writes a whole batch of blocks straight into their host rows (and one
scatter kernel reads them back). No staging memory, one launch per piece; the
SMs drive the PCIe traffic themselves.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvelastic.offload.block_columns import BlockColumns

Indices = Callable[[Sequence[int]], torch.Tensor]


class _HostArrayInterface:
    """Exposes pinned host memory to torch as a CUDA tensor (unified addressing)."""

    def __init__(self, host: torch.Tensor):
        self.owner = host
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "|i1",
                                         "data": (host.data_ptr(), False), "version": 3,
                                         "strides": None}


class DirectCopy:
    """Gather/scatter kernels between the block views and host rows seen from the device."""

    def __init__(self, columns: BlockColumns, host: torch.Tensor, device: torch.device):
        self.columns = columns
        if device.type == "cuda":
            host = torch.as_tensor(_HostArrayInterface(host), device=device)
        self.host_rows = columns.rows(host)

    def store(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices) -> None:
        blocks, rows = indices(block_ids), indices(slots)
        for view, c0, c1 in self.columns.pieces():
            self.host_rows[:, c0:c1].index_copy_(0, rows, view.index_select(0, blocks))

    def load(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices) -> None:
        blocks, rows = indices(block_ids), indices(slots)
        for view, c0, c1 in self.columns.pieces():
            view.index_copy_(0, blocks, self.host_rows[:, c0:c1].index_select(0, rows))
