"""GPU time of the host tier's copies, read from CUDA events without ever waiting for one.

Raw copy benchmarks and the engine can disagree (a multi-turn A/B followed the
host buffer's kind while ``bench_copy.py`` found both kinds equally fast), so
the engine measures its own copies: each batch is
bracketed by two timing events on the copier's stream. The first fires when the
stream reaches the batch (after the compute it waits for), the second when the
batch is done, so their distance is the copy's own time on the GPU, whatever
else the GPU runs beside it.

The engine thread only records and appends; whoever reads the totals (the
upkeep thread's log line and metrics) takes the finished batches off the front,
asking each end event whether it has fired (``query``, never ``synchronize``).
The copy stream's batches finish in the order appended; write-through's stores on a stream of their
own may finish out of it, and a batch is then read once every
batch before it is done too. Their seconds may overlap the copy stream's.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Literal

import torch

Direction = Literal["store", "load"]
#: Batches waiting to be read before the engine thread stops timing new ones (a reader that
#: never comes must not let the queue grow without end).
PENDING_LIMIT = 4096


class CopyClock:
    """Seconds and bytes of the copier's finished batches, per direction."""

    def __init__(self, pending_limit: int = PENDING_LIMIT):
        self.seconds: dict[Direction, float] = {"store": 0.0, "load": 0.0}
        self.bytes: dict[Direction, int] = {"store": 0, "load": 0}
        self.untimed = 0  # batches left untimed while the queue was full
        self._pending: deque[tuple[Direction, int, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._limit = pending_limit
        self._reading = threading.Lock()  # readers only; the engine thread never takes it

    def start(self, stream: torch.cuda.Stream) -> torch.cuda.Event | None:
        """An event on ``stream`` before a batch; None (the batch goes untimed) while the queue is full."""
        if len(self._pending) >= self._limit:
            self.untimed += 1
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def finish(self, direction: Direction, nbytes: int, start: torch.cuda.Event | None,
               end: torch.cuda.Event) -> None:
        """The batch begun at ``start`` ends at ``end`` (a timing event recorded after it on the same stream)."""
        if start is not None:
            self._pending.append((direction, nbytes, start, end))

    def totals(self) -> dict[str, float]:
        """``store_seconds``, ``load_seconds``, ``store_timed_bytes``, ``load_timed_bytes`` of the batches done."""
        with self._reading:
            while self._pending and self._pending[0][3].query():
                direction, nbytes, start, end = self._pending.popleft()
                self.seconds[direction] += start.elapsed_time(end) / 1e3
                self.bytes[direction] += nbytes
        return {"store_seconds": self.seconds["store"], "load_seconds": self.seconds["load"],
                "store_timed_bytes": float(self.bytes["store"]), "load_timed_bytes": float(self.bytes["load"])}
