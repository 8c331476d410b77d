"""Block copies through a device staging buffer and the GPU's DMA engines.

The copies that run beside compute (write-through's stores on their own
stream, and the loads nothing waits for) move this way: their SM work is only
a gather (or scatter) at device-memory speed, and the PCIe traffic runs on the
copy engines. A batch is gathered on the device into a staging buffer laid out
exactly like host rows, and each run of consecutive host slots then moves in
one DMA copy; loads do the same in reverse. Blocks are taken in slot order so
that runs are as long as the slots allow. The staging buffer is small and
reused chunk after chunk; all of it happens on one stream, so reuse needs no
synchronisation.

A DMA copy may not cross from one pinned registration into the next (the
driver refuses it with "invalid argument"), and the host tier's buffer is
registered in chunks (``host_memory.py``), so a run also ends where a chunk
begins (``breaks``).

The gather (and the scatter back) is a pair of kernels per block piece by
default, or (``fused=True``) one Triton kernel per chunk that moves every piece
(``fused_copy``, with the staging rows as its target): far fewer launches from
the thread that issues the copies when a batch spans many chunks.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Iterator, Sequence

import torch

from kvelastic.offload.block_columns import BlockColumns
from kvelastic.offload.fused_copy import FusedCopy

Indices = Callable[[Sequence[int]], torch.Tensor]


def slot_runs(slots: Sequence[int], breaks: AbstractSet[int] = frozenset()) -> Iterator[tuple[int, int, int]]:
    """(first position, first slot, length) of each run of consecutive slots in ``slots``; a slot in
    ``breaks`` always starts a run."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or slots[i] in breaks:
            yield start, slots[start], i - start
            start = i


class StagedCopy:
    """Gather into staging rows, then one DMA per run of host slots (and back)."""

    def __init__(self, columns: BlockColumns, host: torch.Tensor, device: torch.device, staging_bytes: int,
                 breaks: AbstractSet[int] = frozenset(), *, fused: bool = False):
        """``breaks``: the first slot of each pinned registration of ``host`` after the first. ``fused``:
        gather and scatter with one kernel per chunk (a :class:`ConfigError` where Triton cannot run it)."""
        self.columns = columns
        self.host = host
        self.breaks = breaks
        self.rows_per_chunk = max(1, min(staging_bytes // columns.row_bytes, host.shape[0]))
        self.staging = torch.empty((self.rows_per_chunk, columns.row_bytes), dtype=torch.int8, device=device)
        self.fused = FusedCopy(columns, self.staging, device) if fused else None

    def _chunks(self, block_ids: Sequence[int], slots: Sequence[int]) -> Iterator[tuple[list[int], list[int]]]:
        order = sorted(range(len(slots)), key=slots.__getitem__)
        for start in range(0, len(order), self.rows_per_chunk):
            part = order[start:start + self.rows_per_chunk]
            yield [block_ids[i] for i in part], [slots[i] for i in part]

    def store(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices) -> None:
        for blocks, chunk_slots in self._chunks(block_ids, slots):
            stage = self.staging[:len(blocks)]
            if self.fused is not None:
                self.fused.store(blocks, range(len(blocks)), indices)
            else:
                wide, index = self.columns.rows(stage), indices(blocks)
                for view, c0, c1 in self.columns.pieces():
                    torch.index_select(view, 0, index, out=wide[:, c0:c1])
            for row, slot, count in slot_runs(chunk_slots, self.breaks):
                self.host[slot:slot + count].copy_(stage[row:row + count], non_blocking=True)

    def load(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices) -> None:
        for blocks, chunk_slots in self._chunks(block_ids, slots):
            stage = self.staging[:len(blocks)]
            for row, slot, count in slot_runs(chunk_slots, self.breaks):
                stage[row:row + count].copy_(self.host[slot:slot + count], non_blocking=True)
            if self.fused is not None:
                self.fused.load(blocks, range(len(blocks)), indices)
                continue
            wide, index = self.columns.rows(stage), indices(blocks)
            for view, c0, c1 in self.columns.pieces():
                view.index_copy_(0, index, wide[:, c0:c1])
