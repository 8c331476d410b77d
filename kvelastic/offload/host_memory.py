"""The host tier's memory: one contiguous buffer, pinned chunk by chunk in the background.

Pinning is page-faulting and page-locking every byte: about 1.7 GB/s on one
thread (48 GiB took 28.9 s on an H100 host), far too long to keep an engine
from serving. So the buffer is reserved at once (an anonymous mapping, nothing
touched) and pinned by a few daemon threads, chunk after chunk, while the
engine starts and serves; the tier hands out only slots inside the pinned
prefix (:attr:`HostMemory.ready_slots`), which grows as chunks complete.

Why one buffer, registered in pieces (``cuMemHostRegister`` on sub-ranges),
rather than separately pinned chunks: the copiers address the host rows of one
tensor, the direct path through one device view of its base pointer. With
unified addressing a registered page's device address is its host address, so
that view stays valid over every registered piece. Each chunk holds whole
slots and starts on a page, so no slot straddles two registrations and no
page is registered twice. The first chunk is small and pinned in the
constructor: the base pointer is registered before a copier looks at it, and a
host that cannot pin at all fails at start-up with a clear error.

Why threads help: most of the cost is faulting and zeroing pages, which runs in
parallel (``MADV_POPULATE_WRITE`` before the register call, outside the
driver's lock); the register call then only locks pages already present.

Failure mid-way (the host refuses to lock more): one warning, the chunks
pinned so far stay, and the tier works smaller. The scheduler thread never
takes a lock here: it reads two attributes (:attr:`ready_slots`,
:attr:`settled`) that only grow.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import math
import mmap
import threading
import time
import weakref
from typing import Callable, Protocol

from kvelastic.errors import KvelasticError
from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")

PAGE = mmap.PAGESIZE
#: Bytes per background chunk: large enough that a driver call per chunk costs nothing,
#: small enough that slots arrive steadily and a stop waits for little.
CHUNK_BYTES = 256 * 1024 * 1024
#: The chunk pinned in the constructor (rounded up to whole slots on whole pages).
HEAD_BYTES = 2 * 1024 * 1024
#: Background threads (scripts/bench_pin.py measures the choice).
THREADS = 4
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels refuse it and the register call faults the pages

#: ``watch`` callbacks get (ready slots, settled).
Progress = Callable[[int, bool], None]


class PinError(KvelasticError):
    """A range of host memory could not be pinned (the host refuses to lock more, or the driver failed)."""


class SlotSupply(Protocol):
    """Slots ``[0, ready_slots)`` may be handed out; once ``settled``, no more will come.

    Both only grow, and a reader that sees ``settled`` before reading
    ``ready_slots`` reads the final count. :class:`HostMemory` is one; under
    tensor parallelism the scheduler reads the least of its ranks' counts
    (``kvelastic/tp/host_supply.py``).
    """

    @property
    def ready_slots(self) -> int: ...

    @property
    def settled(self) -> bool: ...


class Pinner(Protocol):
    """Pins and unpins ranges of host memory; called from the background threads."""

    def pin(self, address: int, nbytes: int) -> None:
        """Pin ``nbytes`` at ``address``; :class:`PinError` if it cannot be done."""

    def unpin(self, address: int) -> None:
        """Undo the ``pin`` that started at ``address``."""


class CudaPinner:
    """``cuMemHostRegister`` in the primary context of the current torch device (portable, device-mapped)."""

    def __init__(self, device: int | None = None):
        from kvelastic.pool import cuda_driver

        index = cuda_driver.torch_device_index(device)
        cuda_driver.init_driver()
        self._driver = cuda_driver.driver()
        self._check = cuda_driver.check
        _, context = cuda_driver.retain_primary_context(index)
        self._binder = cuda_driver.ContextBinder(context)  # a new thread has no current context
        flags = self._driver.CU_MEMHOSTREGISTER_PORTABLE | self._driver.CU_MEMHOSTREGISTER_DEVICEMAP
        self._flags = int(flags)

    def pin(self, address: int, nbytes: int) -> None:
        try:
            self._binder.bind()
            self._check("cuMemHostRegister", self._driver.cuMemHostRegister(address, nbytes, self._flags),
                        requested_bytes=nbytes)
        except KvelasticError as exc:
            raise PinError(str(exc)) from exc

    def unpin(self, address: int) -> None:
        self._binder.bind()
        self._check("cuMemHostUnregister", self._driver.cuMemHostUnregister(address))


def _madvise(address: int, nbytes: int, advice: int) -> bool:
    """``madvise``; False where the kernel refuses (old kernel, no THP): both uses are only hints."""
    libc = _libc()
    return libc is not None and libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice) == 0


_LIBC: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))  # ctypes calls release the GIL
        except OSError:  # pragma: no cover - no dynamic libc
            _LIBC.append(None)
    return _LIBC[0]


def chunk_plan(slots: int, slot_bytes: int, chunk_bytes: int = CHUNK_BYTES,
               head_bytes: int = HEAD_BYTES) -> list[tuple[int, int]]:
    """(first slot, end slot) of each chunk: whole slots, each chunk starting on a page.

    The first chunk is about ``head_bytes``, the others about ``chunk_bytes``.
    """
    unit = PAGE // math.gcd(slot_bytes, PAGE)  # slots per page-aligned unit

    def rounded(nbytes: int) -> int:
        return max(unit, -(-max(1, nbytes // slot_bytes) // unit) * unit)

    plan, start, size = [], 0, rounded(head_bytes)
    while start < slots:
        end = min(slots, start + size)
        plan.append((start, end))
        start, size = end, rounded(chunk_bytes)
    return plan


class HostMemory:
    """A (slots, slot_bytes) int8 host buffer whose slots ``[0, ready_slots)`` are pinned.

    ``pinner=None``: nothing to pin (a host-backend engine, tests): every slot
    is ready at once and no thread starts.

    ``deferred``: the threads start only at :meth:`begin`. A tensor-parallel
    rank builds its tier before vLLM captures its CUDA graphs, and capture
    (torch's global mode) fails when any thread of the process registers host
    memory meanwhile (``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED``, then the
    capture is invalidated and the engine does not start: 2 x H200, vLLM 0.25).
    """

    def __init__(self, slots: int, slot_bytes: int, *, pinner: Pinner | None, chunk_bytes: int = CHUNK_BYTES,
                 head_bytes: int = HEAD_BYTES, threads: int = THREADS, hugepages: bool = True,
                 deferred: bool = False):
        import torch

        self.slots = slots
        self.slot_bytes = slot_bytes
        self._mapping: mmap.mmap | None = mmap.mmap(-1, -(-slots * slot_bytes // PAGE) * PAGE)  # untouched
        self.buffer = torch.frombuffer(self._mapping, dtype=torch.int8, count=slots * slot_bytes).view(slots,
                                                                                                     slot_bytes)
        self.address = self.buffer.data_ptr()
        self._pinner = pinner
        self._plan = chunk_plan(slots, slot_bytes, chunk_bytes, head_bytes) if pinner is not None else []
        self._lock = threading.Lock()  # the pin threads' and watch's only; the scheduler never takes it
        self._stop = threading.Event()
        self._pinned: set[int] = set()  # chunks pinned (and not given back)
        self._next = 0  # the next chunk to hand to a thread
        self._prefix = 0  # chunks [0, _prefix) are all pinned
        self._failed: str | None = None
        self._watchers: list[Progress] = []
        self._threads: list[threading.Thread] = []
        self._begun = False
        self._started = time.perf_counter()
        self.seconds: float | None = None  # set when settled
        self.ready_slots = 0 if self._plan else slots
        self.settled = not self._plan
        if not self._plan:
            return
        if hugepages:
            _madvise(self.address, self._mapped_bytes(), _MADV_HUGEPAGE)
        self._pin_head()
        _LIVE.add(self)
        self._threads = [threading.Thread(target=self._run, name=f"kvelastic-pin{i}", daemon=True)
                         for i in range(max(1, min(threads, len(self._plan) - 1)))]
        self._running = len(self._threads)
        if not deferred:
            self.begin()

    def begin(self) -> None:
        """Start the pin threads (once; the constructor does, unless ``deferred``)."""
        with self._lock:
            if self._begun or self.settled:
                return
            self._begun = True
            self._started = time.perf_counter()
        for thread in self._threads:
            thread.start()

    @property
    def breaks(self) -> frozenset[int]:
        """The first slot of every chunk but the first: no DMA copy may cross one (each is its own
        registration, and the driver refuses a copy that spans two)."""
        return frozenset(first for first, _ in self._plan[1:])

    @property
    def pinned_bytes(self) -> int:
        return self.ready_slots * self.slot_bytes

    @property
    def failure(self) -> str | None:
        """Why pinning stopped short, or None."""
        return self._failed

    def watch(self, callback: Progress) -> None:
        """Call ``callback(ready_slots, settled)`` now and after every change (from a pin thread)."""
        with self._lock:
            self._watchers.append(callback)
            callback(self.ready_slots, self.settled)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until pinning has settled (tests, benchmarks); False on timeout, or at once if not begun."""
        if not self._begun:
            return self.settled
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.settled

    def close(self, timeout: float = 5.0) -> None:
        """Stop pinning after the chunks in progress; what is pinned stays usable."""
        self._stop.set()
        with self._lock:
            if not self._begun and not self.settled:  # never started: settle on what the head pinned
                self._running = 0
                self._settle()
        self.wait(timeout)

    def free(self) -> None:
        """Stop, unpin everything and drop the buffer (tests, benchmarks; no copy may use it any more)."""
        self.close()
        with self._lock:
            pinned, self._pinned = sorted(self._pinned), set()
            self.ready_slots, self.settled = 0, True
        for i in pinned:
            self._unpin(i)
        self.buffer = None  # type: ignore[assignment]
        self._mapping = None  # type: ignore[assignment]  # unmapped with the last view of it

    # ------------------------------------------------------------ pinning
    def _chunk(self, i: int) -> tuple[int, int]:
        """(address, bytes) of chunk ``i``; the last one runs to the mapping's (page-aligned) end."""
        first, end = self._plan[i]
        stop = self._mapped_bytes() if i == len(self._plan) - 1 else end * self.slot_bytes
        return self.address + first * self.slot_bytes, stop - first * self.slot_bytes

    def _mapped_bytes(self) -> int:
        assert self._mapping is not None  # the buffer is not freed while it is pinned
        return len(self._mapping)

    def _pin_head(self) -> None:
        """Pin the first chunk now; :class:`PinError` if this host cannot pin at all."""
        self._pin(0)
        self._next = 1
        with self._lock:
            self._completed(0)

    def _pin(self, i: int) -> None:
        address, nbytes = self._chunk(i)
        _madvise(address, nbytes, _MADV_POPULATE_WRITE)  # fault and zero here, in parallel, not in the driver
        assert self._pinner is not None
        self._pinner.pin(address, nbytes)

    def _unpin(self, i: int) -> None:
        assert self._pinner is not None
        try:
            self._pinner.unpin(self._chunk(i)[0])
        except Exception as exc:  # noqa: BLE001 - giving memory back must not take the engine down
            log.warning("kvelastic: could not unpin a host-tier chunk (%s)", exc)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    if self._failed is not None or self._next >= len(self._plan):
                        break
                    i, self._next = self._next, self._next + 1
                try:
                    self._pin(i)
                except PinError as exc:
                    with self._lock:
                        self._failed = self._failed or str(exc)
                    break
                with self._lock:
                    self._completed(i)
        except Exception as exc:  # noqa: BLE001 - a pin thread must never take the engine down
            with self._lock:
                self._failed = self._failed or repr(exc)
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._settle()

    def _completed(self, i: int) -> None:
        """Under the lock: chunk ``i`` is pinned; grow the ready prefix and tell the watchers."""
        self._pinned.add(i)
        while self._prefix < len(self._plan) and self._prefix in self._pinned:
            self._prefix += 1
        ready = self._plan[self._prefix - 1][1] if self._prefix else 0
        if ready != self.ready_slots:
            self.ready_slots = ready
            self._tell()

    def _settle(self) -> None:
        """Under the lock, once: chunks pinned past a gap can never be handed out; give them back."""
        for i in sorted(self._pinned):
            if i >= self._prefix:
                self._pinned.discard(i)
                self._unpin(i)
        self.seconds = time.perf_counter() - self._started
        self.settled = True
        _LIVE.discard(self)
        if self._failed is not None:
            log.warning("kvelastic: host tier pinned only %s of %s (%s); it works with the %d blocks pinned",
                        format_size(self.pinned_bytes), format_size(self.slots * self.slot_bytes),
                        self._failed, self.ready_slots)
        elif self._prefix < len(self._plan):
            log.info("kvelastic: host tier pinning stopped at %s of %s (shutting down)",
                     format_size(self.pinned_bytes), format_size(self.slots * self.slot_bytes))
        else:
            log.info("kvelastic: host tier pinned %s in %.2f s (background)", format_size(self.pinned_bytes),
                     self.seconds)
        self._tell()

    def _tell(self) -> None:
        for callback in self._watchers:
            try:
                callback(self.ready_slots, self.settled)
            except Exception:  # noqa: BLE001 - a watcher's failure must not stop pinning
                log.exception("kvelastic: a host-tier pinning watcher failed")


_LIVE: "weakref.WeakSet[HostMemory]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At exit, let no pin thread sit in a driver call while CUDA tears down."""
    for memory in list(_LIVE):
        memory.close(timeout=2.0)
