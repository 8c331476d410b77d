"""Steps of GPU work back to back on a thread of their own, as an engine's forward passes, each timed.

Shared by the benchmarks that ask what something beside the steps costs them (``bench_reserve_growth``:
the pool's growth; ``bench_copy_beside``: the host tier's stores). One step is in flight at a time,
as an engine's: a bf16 matmul (compute) and, with ``copy_mib``, a device-memory copy (memory traffic).
On CUDA each step's milliseconds come from CUDA events; on a CPU (smoke tests) from the wall clock.
"""

from __future__ import annotations

import threading
import time

import torch

MIB = 1024 * 1024


class Steps:
    """The steps' thread, started and stopped by ``with``; ``times``: each step's milliseconds."""

    def __init__(self, matmul: int, copy_mib: int = 0, device: str | torch.device = "cuda"):
        self.device = torch.device(device)
        self.a = torch.randn(matmul, matmul, device=self.device, dtype=torch.bfloat16)
        self.src = torch.empty(copy_mib * MIB, dtype=torch.int8, device=self.device) if copy_mib else None
        self.dst = torch.empty_like(self.src) if self.src is not None else None
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _step(self) -> None:
        torch.mm(self.a, self.a)
        if self.src is not None:
            self.dst.copy_(self.src)

    def _run(self) -> None:
        cuda = self.device.type == "cuda"
        while not self.stop.is_set():
            if not cuda:
                began = time.perf_counter()
                self._step()
                self.times.append((time.perf_counter() - began) * 1e3)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._step()
            end.record()
            end.synchronize()  # one step in flight, as an engine's
            self.times.append(start.elapsed_time(end))

    def __enter__(self) -> "Steps":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
