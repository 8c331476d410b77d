"""Block copies that move runs of blocks on the copy engines, and the rest with the direct kernels.

Why. The direct path's gather and scatter kernels run on the SMs, and the driver's
map calls (cuMemMap + cuMemSetAccess, issued by the mapper thread while a reload
copies) are held up while such kernels run: on an H100 (``scripts/bench_vmm_map.py``)
mapping 2 GiB took 48.6 ms beside the direct kernels instead of 8.7 ms (8 MiB pages),
and 9.5 ms beside copy-engine transfers of the same bytes, which moved them as fast
(42.5 ms against 44.3). So a reload whose maps should hide
behind its copies wants the copies on the copy engines.

How. A host row holds one block with its pieces side by side; on the device each
piece's blocks are rows of a view, ``stride(0)`` bytes apart. A *run* is a stretch
of the batch whose block ids and host slots both go up by one: each of its pieces
is then one strided 2D transfer (``cuMemcpy2DAsync``: one row per block, the
host's pitch the row size, the device's pitch the view's row stride), issued on
the current stream (the copier's copy stream). Runs shorter than ``min_blocks``,
and everything else, go through :class:`DirectCopy` in one batched call. A run
never crosses a host slot in ``breaks`` (the start of a separately pinned chunk:
the driver refuses a copy spanning two registrations, see ``staged_copy``).

On a CPU (tests, the host backend) the same runs move as tensor slice copies
(:class:`SliceTransfers`), so the split and the bookkeeping are exercised end to
end; the driver path itself (:class:`DriverTransfers`) refuses non-CUDA memory.

Not done: ``cuMemcpy3DBatchAsync`` could queue every transfer of a batch in one
call. A 16k-token 8B reload as one run is 64 calls of a few microseconds each
(~0.3 ms of host time beside ~42 ms of transfer), so the gain is small, and the
batch API needs a 12.8+ driver whose operand semantics could not be checked
without a GPU.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import AbstractSet, Any, Callable, Protocol, Sequence

import torch

from kvelastic.errors import ConfigError, DriverError
from kvelastic.offload.block_columns import BlockColumns, check_range
from kvelastic.offload.direct_copy import DirectCopy

Indices = Callable[[Sequence[int]], torch.Tensor]

#: The shortest run that goes to the copy engines; shorter runs join the direct kernels' batch.
#: Why 16: a run costs one driver call per piece (64 on 8B, 32 on 1B), a few microseconds of host
#: time each, while a block moves in about 42 us (8B, 2 MiB at 50 GB/s) or 10 us (1B, 512 KiB).
#: From about 5 (8B) and 10 (1B) blocks on, the engines' work outlasts the calls that queue it, and
#: at 16 each transfer is at least 256 KiB (1B) / 512 KiB (8B), far above the engines' per-transfer
#: setup. The direct kernels cost about the same per batch whatever its size, so a short run gains
#: nothing there. A starting point, not a measurement: ``bench_copy.py --run-min-blocks`` tunes it.
MIN_RUN_BLOCKS = 16


@dataclass(frozen=True)
class Run:
    """``count`` blocks from ``block`` on, each to (or from) the host slot ``slot`` + the same offset."""

    block: int
    slot: int
    count: int


@dataclass(frozen=True)
class Split:
    """A batch cut in two: the ``runs`` (in slot order) and the positions of the ``rest`` (in batch order)."""

    runs: tuple[Run, ...]
    rest: tuple[int, ...]

    def run_blocks(self) -> int:
        return sum(run.count for run in self.runs)


def split_runs(block_ids: Sequence[int], slots: Sequence[int], *, min_blocks: int = MIN_RUN_BLOCKS,
               breaks: AbstractSet[int] = frozenset()) -> Split:
    """Find the runs of at least ``min_blocks`` pairs whose block ids and slots both go up by one.

    The pairs are taken in slot order, so a batch listed in any order still yields its runs (the
    host tier hands out consecutive slots, and a spilled prefix keeps its blocks' order). A slot in
    ``breaks`` always starts a new run. Every position of the batch ends up in exactly one run or in
    ``rest``: a duplicate pair never extends a run (its slot does not go up).
    """
    if len(block_ids) != len(slots):
        raise ValueError(f"{len(block_ids)} blocks but {len(slots)} host slots")
    if min_blocks < 1:
        raise ValueError(f"min_blocks must be at least 1, not {min_blocks}")
    order = sorted(range(len(slots)), key=slots.__getitem__)  # timsort: linear on a sorted batch
    runs: list[Run] = []
    rest: list[int] = []
    start = 0
    for i in range(1, len(order) + 1):
        if i < len(order):
            prev, here = order[i - 1], order[i]
            if (slots[here] == slots[prev] + 1 and block_ids[here] == block_ids[prev] + 1
                    and slots[here] not in breaks):
                continue
        if i - start >= min_blocks:
            first = order[start]
            runs.append(Run(block_ids[first], slots[first], i - start))
        else:
            rest.extend(order[start:i])
        start = i
    rest.sort()
    return Split(tuple(runs), tuple(rest))


@dataclass(frozen=True)
class Piece:
    """One piece of a block in bytes: where block 0's piece is on the device, the stride between
    blocks, the offset of the piece in a host row, and its width."""

    device_ptr: int
    device_pitch: int
    host_offset: int
    width: int


def pieces_of(columns: BlockColumns) -> list[Piece]:
    """Each view's piece as a strided 2D region; refuses views whose rows are not contiguous bytes."""
    size = torch.empty((), dtype=columns.dtype).element_size()
    pieces = []
    for view, c0, c1 in columns.pieces():
        width = (c1 - c0) * size
        pitch = view.stride(0) * size
        if view.dim() != 2 or (view.shape[1] > 1 and view.stride(1) != 1) or pitch < width:
            raise ConfigError(f"the copy engines copy rows of contiguous bytes, and a block view has "
                              f"shape {tuple(view.shape)}, strides {view.stride()}")
        pieces.append(Piece(view.data_ptr(), pitch, c0 * size, width))
    return pieces


class Transfers(Protocol):
    """Moves whole runs of blocks between the views and the host rows."""

    def move(self, runs: Sequence[Run], to_host: bool) -> None: ...


class SliceTransfers:
    """Runs as tensor slice copies: the CPU stand-in for the copy engines (tests, host backend)."""

    def __init__(self, columns: BlockColumns, host: torch.Tensor):
        self.columns = columns
        self.rows = columns.rows(host)

    def move(self, runs: Sequence[Run], to_host: bool) -> None:
        for run in runs:
            host_rows = self.rows[run.slot:run.slot + run.count]
            for view, c0, c1 in self.columns.pieces():
                blocks = view[run.block:run.block + run.count]
                if to_host:
                    host_rows[:, c0:c1].copy_(blocks)
                else:
                    blocks.copy_(host_rows[:, c0:c1])


class DriverTransfers:
    """Runs as one ``cuMemcpy2DAsync`` per piece per run, on the stream ``stream()`` names.

    The transfer descriptions are built once per piece and direction; a run only sets the two
    addresses and the height (the driver reads the description during the call, so reuse is safe).
    """

    def __init__(self, pieces: Sequence[Piece], host_ptr: int, host_pitch: int, *, driver: ModuleType,
                 stream: Callable[[], int], max_pitch: int, bind: Callable[[], None] = lambda: None):
        for pitch in (host_pitch, *(p.device_pitch for p in pieces)):
            if pitch > max_pitch:
                raise ConfigError(f"the copy engines: a row pitch of {pitch} bytes exceeds the device's "
                                  f"largest 2D copy pitch ({max_pitch})")
        self.pieces = list(pieces)
        self.host_ptr, self.host_pitch = host_ptr, host_pitch
        self.driver, self.stream, self.bind = driver, stream, bind
        self._load = [self._describe(p, to_host=False) for p in self.pieces]
        self._store = [self._describe(p, to_host=True) for p in self.pieces]

    def _describe(self, piece: Piece, *, to_host: bool) -> Any:
        d = self.driver
        c = d.CUDA_MEMCPY2D()
        host, device = d.CUmemorytype.CU_MEMORYTYPE_HOST, d.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.srcMemoryType, c.dstMemoryType = (device, host) if to_host else (host, device)
        c.srcPitch, c.dstPitch = ((piece.device_pitch, self.host_pitch) if to_host
                                  else (self.host_pitch, piece.device_pitch))
        c.WidthInBytes = piece.width
        return c

    def move(self, runs: Sequence[Run], to_host: bool) -> None:
        """Queue every run's transfers; a refused call raises :class:`DriverError` naming how many went out."""
        if not runs:
            return
        self.bind()
        stream = self.stream()
        described = self._store if to_host else self._load
        total, issued = len(runs) * len(self.pieces), 0
        for run in runs:
            host_row = self.host_ptr + run.slot * self.host_pitch
            for piece, c in zip(self.pieces, described):
                device = piece.device_ptr + run.block * piece.device_pitch
                if to_host:
                    c.srcDevice, c.dstHost = device, host_row + piece.host_offset
                else:
                    c.srcHost, c.dstDevice = host_row + piece.host_offset, device
                c.Height = run.count
                err = self.driver.cuMemcpy2DAsync(c, stream)[0]
                if int(err):
                    _refused(err, issued, total)
                issued += 1


def _refused(err: Any, issued: int, total: int) -> None:
    from kvelastic.pool.cuda_driver import error_name, error_string

    detail = error_string(err)
    raise DriverError("cuMemcpy2DAsync", error_name(err),
                      f"{detail + '; ' if detail else ''}{issued} of the batch's {total} transfers were queued "
                      f"before it: the batch is incomplete")


def driver_transfers(columns: BlockColumns, host: torch.Tensor) -> DriverTransfers:
    """The copy-engine transfers between CUDA views and ``host`` rows (refuses views off a CUDA device).

    ``host`` is pinned by the tier's contract (torch's pinned allocation, or the tier's buffer
    registered chunk by chunk, which ``is_pinned`` need not recognise), so it is not checked here:
    from pageable rows the driver would still copy correctly, only synchronously.
    """
    device = columns.views[0].device
    if device.type != "cuda" or any(v.device != device for v in columns.views) or host.device.type != "cpu":
        raise ConfigError(f"runs move on a CUDA device's copy engines, and the blocks are on {device}")
    from kvelastic.pool import cuda_driver

    index = cuda_driver.torch_device_index(device.index)
    cuda_driver.init_driver()
    cu_device, context = cuda_driver.retain_primary_context(index)
    binder = cuda_driver.ContextBinder(context)
    max_pitch = cuda_driver.device_attribute(cu_device, "CU_DEVICE_ATTRIBUTE_MAX_PITCH")
    transfers = DriverTransfers(pieces_of(columns), host.data_ptr(), host.stride(0) * host.element_size(),
                                driver=cuda_driver.driver(), max_pitch=max_pitch, bind=binder.bind,
                                stream=lambda: torch.cuda.current_stream(device).cuda_stream)
    release = weakref.finalize(transfers, cuda_driver.release_primary_context, cu_device)
    release.atexit = False  # at exit the context goes with the process; the driver may be torn down already
    return transfers


class RunCopy:
    """Runs of blocks on the copy engines, the rest through :class:`DirectCopy`: ``DirectCopy``'s interface."""

    def __init__(self, columns: BlockColumns, host: torch.Tensor, device: torch.device,
                 breaks: AbstractSet[int] = frozenset(), *, min_blocks: int = MIN_RUN_BLOCKS,
                 transfers: Transfers | None = None):
        """``breaks``: the first slot of each pinned registration of ``host`` after the first."""
        if transfers is None:
            transfers = driver_transfers(columns, host) if device.type == "cuda" else SliceTransfers(columns, host)
        self.transfers = transfers
        self.direct = DirectCopy(columns, host, device)
        self.breaks = breaks
        self.min_blocks = min_blocks
        self.num_blocks = min(v.shape[0] for v in columns.views)
        self.num_slots = host.shape[0]
        #: Blocks moved so far as runs (copy engines) and by the direct kernels (for benches and logs).
        self.moved = {"runs": 0, "direct": 0}

    def store(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices) -> None:
        self._copy(block_ids, slots, indices, to_host=True)

    def load(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices) -> None:
        self._copy(block_ids, slots, indices, to_host=False)

    def _copy(self, block_ids: Sequence[int], slots: Sequence[int], indices: Indices, *, to_host: bool) -> None:
        """Check everything first (no copy goes out for a batch that cannot go out whole), then queue
        the runs and then the rest, all on the current stream."""
        split = split_runs(block_ids, slots, min_blocks=self.min_blocks, breaks=self.breaks)
        # A 2D copy writes through raw addresses: an id out of range would corrupt memory, not raise.
        check_range(block_ids, self.num_blocks, "block id")
        check_range(slots, self.num_slots, "host slot")
        self.transfers.move(split.runs, to_host)
        if split.rest:
            rest_blocks = [block_ids[i] for i in split.rest]
            rest_slots = [slots[i] for i in split.rest]
            (self.direct.store if to_host else self.direct.load)(rest_blocks, rest_slots, indices)
        self.moved["runs"] += split.run_blocks()
        self.moved["direct"] += len(split.rest)
