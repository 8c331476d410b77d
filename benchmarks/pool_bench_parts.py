"""Pieces the pool's small benchmarks share: a backend by name, a thread of pure Python, the output.

Used by ``bench_account_pages.py`` and ``bench_gil_convoy.py`` (run from the repository root with
``PYTHONPATH=.``, or from ``benchmarks/``).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Sequence

from kvelastic.pool import HostBackend


def backend_for(name: str) -> Any:
    """``host`` (process memory, any machine) or ``cuda`` (the current CUDA device)."""
    if name == "host":
        return HostBackend()
    import torch

    from kvelastic.pool.cuda import CudaBackend

    return CudaBackend(torch.cuda.current_device())


def python_unit() -> None:
    """A slice of pure-Python work (about 0.1 ms): what a scheduling step is made of."""
    total = 0
    for i in range(2000):
        total += i * i
    del total


class PythonBusy:
    """A thread running :func:`python_unit` back to back (vLLM's busy loop, as far as the GIL can tell)."""

    def __init__(self) -> None:
        self.units = 0
        self._started = self._ended = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stand-in-busy-loop", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            python_unit()
            self.units += 1

    def __enter__(self) -> "PythonBusy":
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._ended = time.perf_counter()

    @property
    def units_per_s(self) -> float:
        """Its pace over its whole life (once it has ended): what the other threads left it."""
        return self.units / max(1e-9, self._ended - self._started)


def busy_pace_alone(seconds: float = 0.5) -> float:
    """Units a second that :class:`PythonBusy` runs with nothing else in the process working."""
    with PythonBusy() as busy:
        time.sleep(seconds)
    return busy.units_per_s


def print_table(title: str, columns: Sequence[tuple[str, str, str]], rows: Sequence[dict[str, Any]]) -> None:
    """``columns``: (heading, key, format spec such as ``>8.2f``); one line a row."""
    print(title)
    print(" ".join(f"{heading:{spec.split('.')[0].rstrip('fds')}}" for heading, _, spec in columns))
    for row in rows:
        print(" ".join(f"{row[key]:{spec}}" for _, key, spec in columns))


def write_json(path: str | None, args: Any, rows: Sequence[dict[str, Any]]) -> None:
    if path:
        with open(path, "w") as out:
            json.dump({"args": vars(args), "results": list(rows)}, out, indent=1)
