"""Batched copies of KV blocks between the GPU cache and host slots.

A block is scattered over every layer's tensor (and, for some attention
backends, over a K run and a V run of each). Copying it with one DMA call per
piece would move tens of kilobytes per call, far below PCIe speed. Instead the
host buffer is addressed from the GPU (pinned memory is mapped into the GPU's
address space), and one gather/scatter kernel per piece kind moves a whole
batch of blocks: the GPU reads and writes host memory directly, in large
coalesced rows.

On CUDA the copies run on their own stream. They start only after the work
already queued on the legacy default stream (vLLM's compute), and a load makes
that stream wait for it, so no host thread ever blocks on the GPU. On a CPU
(tests, host backend) the same index operations run synchronously.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvelastic.pool.backend import DoneFence, Fence


class EventFence(Fence):
    """A torch CUDA event as a pool fence."""

    def __init__(self, event: "torch.cuda.Event"):
        self.event = event

    def is_done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class AllFences(Fence):
    """Passes when every fence in it has passed."""

    def __init__(self, fences: Sequence[Fence]):
        self.fences = list(fences)

    def is_done(self) -> bool:
        return all(f.is_done() for f in self.fences)

    def wait(self) -> None:
        for fence in self.fences:
            fence.wait()


class _HostArrayInterface:
    """Exposes pinned host memory to torch as a CUDA tensor (unified addressing)."""

    def __init__(self, host: torch.Tensor):
        self.owner = host
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "|i1",
                                         "data": (host.data_ptr(), False), "version": 3,
                                         "strides": None}


class BlockCopier:
    """Moves whole blocks between ``block_views`` (each (num_blocks, bytes)) and host rows."""

    def __init__(self, block_views: Sequence[torch.Tensor], host: torch.Tensor):
        widths = [v.shape[1] for v in block_views]
        if sum(widths) != host.shape[1]:
            raise ValueError(f"host slots hold {host.shape[1]} bytes, blocks have {sum(widths)}")
        self.views = list(block_views)
        self.columns: list[tuple[int, int]] = []
        offset = 0
        for width in widths:
            self.columns.append((offset, offset + width))
            offset += width
        self.device = self.views[0].device
        self.cuda = self.device.type == "cuda"
        self.host = host
        self.stream: Any = None
        if self.cuda:
            self.host_on_device = torch.as_tensor(_HostArrayInterface(host), device=self.device)
            self.stream = torch.cuda.Stream(self.device)
        else:
            self.host_on_device = host
        self.bytes_per_block = host.shape[1]

    def _indices(self, values: Sequence[int]) -> torch.Tensor:
        tensor = torch.tensor(list(values), dtype=torch.int64)
        if not self.cuda:
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def store(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = False) -> Fence:
        """Copy blocks to host slots; the returned fence passes when the copy is done.

        ``block_compute``: later compute on the legacy stream waits for the copy
        (the blocks are about to be overwritten by new requests).
        """
        if not block_ids:
            return DoneFence()
        with self._on_copy_stream():
            blocks, rows = self._indices(block_ids), self._indices(slots)
            for view, (c0, c1) in zip(self.views, self.columns):
                self.host_on_device[:, c0:c1].index_copy_(0, rows, view.index_select(0, blocks))
            fence = self._done()
        if self.cuda and block_compute:
            torch.cuda.default_stream(self.device).wait_event(fence.event)  # type: ignore[attr-defined]
        return fence

    def load(self, block_ids: Sequence[int], slots: Sequence[int]) -> Fence:
        """Copy host slots into GPU blocks; later compute on the legacy stream waits for it."""
        if not block_ids:
            return DoneFence()
        with self._on_copy_stream():
            blocks, rows = self._indices(block_ids), self._indices(slots)
            for view, (c0, c1) in zip(self.views, self.columns):
                view.index_copy_(0, blocks, self.host_on_device[:, c0:c1].index_select(0, rows))
            fence = self._done()
        if self.cuda:
            torch.cuda.default_stream(self.device).wait_event(fence.event)  # type: ignore[attr-defined]
        return fence

    def _on_copy_stream(self) -> Any:
        if not self.cuda:
            return _Nothing()
        queued = torch.cuda.Event()
        queued.record(torch.cuda.default_stream(self.device))
        self.stream.wait_event(queued)
        return torch.cuda.stream(self.stream)

    def _done(self) -> Fence:
        if not self.cuda:
            return DoneFence()
        event = torch.cuda.Event()
        event.record(self.stream)
        return EventFence(event)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
