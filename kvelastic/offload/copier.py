"""Batched copies of KV blocks between the GPU cache and host slots.

A block is scattered over every layer's tensor (and, for some attention
backends, over a K run and a V run of each), tens of kilobytes per piece, far
too small for one DMA call each. A batch moves one of two ways, chosen from the
pieces' width (:func:`auto_path`):

- ``runs``: runs of blocks whose ids and slots both go up by one move on the
  copy engines (one strided transfer per piece), the rest as ``direct``
  (``run_copy``): the driver's map calls are not held up beside SM copy
  kernels, as they are beside the kernels;
- ``direct``: gather/scatter kernels that read and write the pinned host rows
  themselves, no staging memory (``direct_copy``).

``runs`` is taken where every piece of a block is at least
:data:`RUNS_MIN_PIECE_BYTES` wide on a CUDA device, ``direct`` otherwise.

Write-through's stores on a stream of their own (:meth:`BlockCopier.store_beside`)
may go through a staging buffer of their own (``staged_side_stores``): their SM
work is then a gather at device-memory speed, and the PCIe writes run on the
copy engines, while the kernels of ``direct`` hold their SMs for as long as the
writes take, beside the forward pass. Loads nothing waits for (asynchronous
loads, and the pieces of a long run issued before the step's end), which also
run beside compute, may do the same (``staged_loads``).

On CUDA the copies run on their own stream. They start only after the work
already queued on the legacy default stream (vLLM's compute), and a load makes
that stream wait for it, so no host thread ever blocks on the GPU. A store
makes it wait only when asked (its blocks are about to be overwritten); a
write-through store does not, and :meth:`BlockCopier.fence_compute` makes
compute wait later, if a block it reads is reused. All copies share the one
stream, in the order issued: a host slot is never written or read before the
copies queued into it earlier are done. On a CPU (tests, host backend) the
same operations run synchronously.
"""

from __future__ import annotations

import logging
from typing import AbstractSet, Any, Literal, Sequence

import torch

from kvelastic.errors import ConfigError
from kvelastic.offload.block_columns import BlockColumns
from kvelastic.offload.copy_clock import CopyClock, Direction
from kvelastic.offload.direct_copy import DirectCopy
from kvelastic.offload.fences import EventFence
from kvelastic.offload.run_copy import RunCopy
from kvelastic.offload.staged_copy import StagedCopy
from kvelastic.pool.backend import DoneFence, Fence
from kvelastic.roles import Copier
from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")

__all__ = ["BlockCopier", "CopyPath", "RUNS_MIN_PIECE_BYTES", "auto_path", "resolve_path"]

#: ``auto``: :func:`auto_path`'s choice; ``runs`` and ``direct`` name a mover (tests and benchmarks compare them).
CopyPath = Literal["auto", "direct", "runs"]
#: Each staging buffer (the side stores' and the loads' nothing waits for): a step's write-through batch is
#: usually a few blocks (decode) and at most ``write_through.STEP_BYTES``, which goes through it chunk by chunk.
STAGING_BYTES = 32 * 1024 * 1024
#: Runs go to the copy engines only where every piece is at least this wide. On an H100 (bench_copy.py)
#: strided transfers of 32 KiB pieces (8B shape) beat the direct kernels at every batch size (1024 blocks:
#: 51.3 / 50.3 against 49.3 / 47.3 GB/s each way) and let the driver map beside them (a 16k-token reload
#: of an idle engine: 77.7 against 98.6 ms); transfers of 16 KiB pieces (1B shape, or an 8B shard under
#: TP=2) were slower than the kernels at most sizes.
RUNS_MIN_PIECE_BYTES = 32 * 1024


def resolve_path(path: CopyPath, block_views: Sequence[torch.Tensor]) -> CopyPath:
    """The mover ``auto`` stands for with these views (one row of bytes per block); any other as given."""
    if path != "auto":
        return path
    return auto_path(piece_bytes(block_views), block_views[0].device.type == "cuda")


def piece_bytes(block_views: Sequence[torch.Tensor]) -> list[int]:
    """The bytes of one block in each view: the pieces a copy of a block moves."""
    return [v.shape[1] * v.element_size() for v in block_views]


def auto_path(piece_bytes: Sequence[int], on_cuda: bool) -> CopyPath:
    """``runs`` where every piece is at least :data:`RUNS_MIN_PIECE_BYTES` on a CUDA device, else ``direct``
    (off CUDA there are no copy engines to prefer)."""
    return "runs" if on_cuda and min(piece_bytes) >= RUNS_MIN_PIECE_BYTES else "direct"


class BlockCopier(Copier):
    """Moves whole blocks between ``block_views`` (each (num_blocks, bytes)) and host rows in this process."""

    #: :meth:`store_beside` runs beside the copy stream, on a stream of its own (on a CPU every copy is
    #: synchronous anyway).
    side_stores = True

    def __init__(self, block_views: Sequence[torch.Tensor], host: torch.Tensor, *, path: CopyPath = "auto",
                 breaks: AbstractSet[int] = frozenset(), staged_side_stores: bool = False,
                 staged_loads: bool = False, staging_bytes: int = STAGING_BYTES):
        """``breaks``: the first slot of each separately pinned chunk of ``host`` (no DMA crosses one).
        ``staged_side_stores``: :meth:`store_beside` moves its blocks through a staging buffer of its own
        onto the copy engines (else as the other copies); ``staged_loads``: the same for the loads nothing
        waits for (``load(block_compute=False)``); ``staging_bytes``: each such buffer's size."""
        columns = BlockColumns.of(block_views, host)
        self.device = block_views[0].device
        self.cuda = self.device.type == "cuda"
        self.host = host
        self.bytes_per_block = host.shape[1]
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._side_stream: Any = None  # write-through's stores, when they run beside (store_beside)
        self._side_tail: Fence | None = None  # the last of them (an EventFence: on CUDA only)
        self.clock = CopyClock() if self.cuda else None
        self.path = resolve_path(path, block_views)
        try:
            self.mover = self._mover(self.path, columns, breaks)
        except ConfigError:
            if path != "auto":
                raise
            self.path = "direct"  # a layout the copy engines cannot take: the kernels move it
            self.mover = self._mover(self.path, columns, breaks)
        if path == "auto":
            log.info("kvelastic: host-tier copies run on %s (narrowest piece of a block %s)",
                     "the copy engines" if self.path == "runs" else "GPU kernels",
                     format_size(min(piece_bytes(block_views))))
        # Staging buffers of their own, allocated now: a shortage of GPU memory shows at start-up, not mid-step.
        # The side stores' is used on the side stream only, the other loads' on the copy stream only.
        staged = (columns, host, self.device, breaks, staging_bytes)
        self._side_mover = _staged_mover(staged_side_stores, "side store", *staged)
        self._async_load_mover = _staged_mover(staged_loads, "load", *staged)

    def _mover(self, path: CopyPath, columns: BlockColumns, breaks: AbstractSet[int]) -> DirectCopy | RunCopy:
        if path == "direct":
            return DirectCopy(columns, self.host, self.device)
        if path == "runs":
            return RunCopy(columns, self.host, self.device, breaks)
        raise ValueError(f"unknown copy path {path!r}: use 'auto', 'direct' or 'runs'")

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
        return self._queue("store", block_ids, slots, self.stream, block_compute=block_compute)

    def store_beside(self, block_ids: Sequence[int], slots: Sequence[int]) -> Fence:
        """A store on a second stream (write-through's): it follows the work queued so far on the legacy
        default stream and on the copy stream, and nothing waits for it unless told to
        (:meth:`wait_for`, :meth:`fence_compute`)."""
        if not block_ids:
            return DoneFence()
        mover = self._side_mover or self.mover
        if not self.cuda:  # synchronous: no stream to put it on
            return self._queue("store", block_ids, slots, None, block_compute=False, mover=mover)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        self._side_tail = self._queue("store", block_ids, slots, self._side_stream, block_compute=False,
                                      after=self.stream, mover=mover)
        return self._side_tail

    def wait_for(self, fences: Sequence[Fence]) -> None:
        """The copy stream's next copies start only once ``fences`` (of :meth:`store_beside`) passed."""
        if not self.cuda:
            return
        for fence in fences:
            if isinstance(fence, EventFence):
                self.stream.wait_event(fence.event)

    def load(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = True) -> Fence:
        """Copy host slots into GPU blocks; the returned fence passes when the copy is done.

        ``block_compute``: later compute on the legacy stream waits for it (a
        request scheduled in this step reads the blocks). False: an
        asynchronous load (or a piece of a long run issued before the step's
        end), polled through its fence (through the staging buffer of its own,
        with ``staged_loads``).
        """
        mover = None if block_compute else self._async_load_mover
        return self._queue("load", block_ids, slots, self.stream, block_compute=block_compute, mover=mover)

    def _queue(self, direction: Direction, block_ids: Sequence[int], slots: Sequence[int], stream: Any, *,
               block_compute: bool, after: Any = None, mover: Any = None) -> Fence:
        """One batch on ``stream`` through ``mover`` (the copier's own by default), after the legacy default
        stream's work so far (and ``after``'s, another stream); ``block_compute``: later compute on the
        legacy stream waits for it."""
        if not block_ids:
            return DoneFence()
        mover = mover or self.mover
        with self._on(stream, after):
            start = self._start(stream)
            (mover.store if direction == "store" else mover.load)(block_ids, slots, self._indices)
            fence = self._done(direction, len(block_ids), start, stream)
        if self.cuda and block_compute:
            torch.cuda.default_stream(self.device).wait_event(fence.event)  # type: ignore[attr-defined]
        return fence

    def fence_compute(self) -> None:
        """Later compute on the legacy stream waits for every copy issued so far (the copy stream's, and
        the last side store, which follows every side store before it)."""
        if not self.cuda:
            return
        event = torch.cuda.Event()
        event.record(self.stream)
        compute = torch.cuda.default_stream(self.device)
        compute.wait_event(event)
        if self._side_tail is not None and not self._side_tail.is_done():
            compute.wait_event(self._side_tail.event)  # type: ignore[attr-defined]

    def _on(self, stream: Any, after: Any = None) -> Any:
        """Copies queued on ``stream`` from here follow the legacy default stream's work so far (and
        ``after``'s, another stream)."""
        if not self.cuda:
            return _Nothing()
        for before in (torch.cuda.default_stream(self.device), after):
            if before is not None:
                queued = torch.cuda.Event()
                queued.record(before)
                stream.wait_event(queued)
        return torch.cuda.stream(stream)

    def copy_times(self) -> dict[str, float] | None:
        """GPU seconds and bytes of the batches done so far, per direction (:class:`CopyClock`); None on a CPU."""
        return self.clock.totals() if self.clock is not None else None

    def _start(self, stream: Any) -> "torch.cuda.Event | None":
        return self.clock.start(stream) if self.clock is not None else None

    def _done(self, direction: Direction, blocks: int, start: "torch.cuda.Event | None", stream: Any) -> Fence:
        if self.clock is None:
            return DoneFence()
        event = torch.cuda.Event()  # no timing: CUDA's lightest event to wait on and to query
        event.record(stream)
        if start is not None:  # the clock's end mark is an event of its own, so fences stay light
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self.clock.finish(direction, blocks * self.bytes_per_block, start, end)
        return EventFence(event)


def _staged_mover(wanted: bool, what: str, columns: BlockColumns, host: torch.Tensor, device: torch.device,
                  breaks: AbstractSet[int], staging_bytes: int) -> StagedCopy | None:
    """A staging mover of its own where ``wanted`` (else None: the copier's own mover), gathering (or
    scattering) with one fused kernel a chunk where Triton can run it (a batch of many chunks would
    otherwise cost the issuing thread a launch per piece per chunk), else piece by piece. A device that
    refuses the staging buffer leaves these copies on the copier's own mover, said in the log: an
    engine that starts with a slower copy beats one that does not start."""
    if not wanted:
        return None
    try:
        try:
            return StagedCopy(columns, host, device, staging_bytes, breaks, fused=True)
        except ConfigError as e:
            log.info("kvelastic: the staged %s copies move piece by piece: %s", what, e)
            return StagedCopy(columns, host, device, staging_bytes, breaks)
    except torch.OutOfMemoryError as e:
        log.warning("kvelastic: no %s of GPU memory for the staged %s copies' buffer (%s); they take the "
                    "copier's own path", format_size(staging_bytes), what, str(e).splitlines()[0])
        return None


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
