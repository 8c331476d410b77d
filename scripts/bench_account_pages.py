"""What the GPU's shared account costs the warm reserve's growth and trims (no vLLM).

Every engine joins its GPU's shared account (``kvelastic.cluster``), and its pool's stack asks the
account before creating pages and tells it after destroying them: one locked transaction on the
account file per call. The warm reserve used to grow and trim one page per call (so that it could
step aside for a waiting thread after any page), which made a 256 MiB growth of 2 MiB pages 128
file transactions under the pool's lock. It now calls a batch (``ReserveSource(batch_bytes=)``,
32 MiB by default) at a time.

Per configuration, side by side in one run: the engine's stack (reserve, limit, shared budget,
statistics, device), joined to a real account in a private temporary directory (as an engine joins
its GPU's), grows ``--grow-mib`` of reserve through ``PagePool.grow_reserve`` and trims it back
with ``trim_reserve(0)``; wall ms of each and the account transactions they made, medians over
``--reps``. Configurations: ``no-account`` (the stack never joined), ``page-a-call`` (batch of one
page: the old behaviour) and ``batched`` (the default batch).

A transaction is Python under the GIL (it reads and checks every slot of the file), unlike the
driver's calls (or the host backend's ``fallocate``), which let other threads run. Beside the
growth a thread runs pure-Python units of work back to back, as an engine's scheduling and
kernel launches would: ``lost ms`` is the wall time of grow and trim less the time the units
completed meanwhile took alone, the GIL time the growth took from that thread::

    python scripts/bench_account_pages.py --json /tmp/account_pages.json
    python scripts/bench_account_pages.py --backend cuda --json $OUT/account_pages.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import Any, Callable

from kvelastic.cluster import SharedAccount, SharedBudgetSource
from kvelastic.pool import DeviceSource, HostBackend, LimitedSource, PagePool, ReserveSource, StatisticsSource
from kvelastic.pool.sources import BATCH_BYTES

MIB = 1024 * 1024
ENGINE_LOCK_TIMEOUT_S = 0.005  # what an engine's scheduler waits for the account at most


class TransactionCount:
    """Counts the transactions on one account file (wraps its ``transaction`` method)."""

    def __init__(self, account: SharedAccount):
        file = account._file
        inner = file.transaction
        self.count = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return inner(*args, **kwargs)

        file.transaction = counted  # type: ignore[method-assign]


def backend_for(name: str) -> Any:
    if name == "host":
        return HostBackend()
    import torch

    from kvelastic.pool.cuda import CudaBackend

    return CudaBackend(torch.cuda.current_device())


def timed_ms(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def python_unit() -> None:
    """A slice of pure-Python work (about 0.1 ms): what a scheduling step is made of."""
    total = 0
    for i in range(2000):
        total += i * i
    del total


class PythonStepper:
    """A thread running :func:`python_unit` back to back, noting when each unit ended."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stand-in-engine", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            python_unit()
            self.ends.append(time.perf_counter())

    def __enter__(self) -> "PythonStepper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def lost_ms(self, start: float, end: float, unit_s: float) -> float:
        """Wall ms of ``[start, end]`` less the time its completed units take alone."""
        done = sum(1 for t in self.ends if start < t <= end)
        return (end - start - done * unit_s) * 1e3


def unit_alone_s(reps: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        python_unit()
    return (time.perf_counter() - start) / reps


def run_config(name: str, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """One configuration's reps: grow then trim, timed, with the account's transactions counted."""
    page = args.page_mib * MIB
    pages = args.grow_mib * MIB // page
    batch = page if name == "page-a-call" else BATCH_BYTES
    backend = backend_for(args.backend)
    budget = SharedBudgetSource(StatisticsSource(DeviceSource(backend, page)))
    pool = PagePool(backend, ReserveSource(LimitedSource(budget), batch_bytes=batch), park=False)
    rows: dict[str, list[float]] = {"grow_ms": [], "trim_ms": [], "grow_transactions": [], "trim_transactions": [],
                                    "lost_ms": []}
    with ExitStack() as stack:
        counter = None
        if name != "no-account":
            account = stack.enter_context(SharedAccount.open(f"bench-{name}", 1 << 40, directory=directory,
                                                             lock_timeout_s=ENGINE_LOCK_TIMEOUT_S))
            member = stack.enter_context(account.join(name))
            budget.attach(member)
            counter = TransactionCount(account)
        unit_s = unit_alone_s()
        stepper = stack.enter_context(PythonStepper())
        for _ in range(args.reps):
            before = counter.count if counter else 0
            start = time.perf_counter()
            rows["grow_ms"].append(timed_ms(lambda: pool.grow_reserve(pages)))
            middle = counter.count if counter else 0
            rows["trim_ms"].append(timed_ms(lambda: pool.trim_reserve(0)))
            rows["lost_ms"].append(stepper.lost_ms(start, time.perf_counter(), unit_s))
            after = counter.count if counter else 0
            rows["grow_transactions"].append(middle - before)
            rows["trim_transactions"].append(after - middle)
            assert pool.stats().held_bytes == 0
        pool.close()
    return {"config": name, "pages": pages, "batch_pages": max(1, batch // page),
            **{key: statistics.median(values) for key, values in rows.items()}, "raw": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--page-mib", type=int, default=2, help="page size (KVELASTIC_CHUNK_SIZE)")
    parser.add_argument("--grow-mib", type=int, default=256, help="reserve grown and trimmed per rep")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="kvelastic-bench-")
    os.chmod(directory, 0o700)
    os.environ["KVELASTIC_SHARED_DIR"] = directory  # the account's scope: a private directory of this run
    results = [run_config(name, args, directory) for name in ("no-account", "page-a-call", "batched")]
    print(f"{args.grow_mib} MiB of {args.page_mib} MiB pages on {args.backend}; medians of {args.reps} reps")
    print(f"{'config':<12} {'batch':>5} {'grow ms':>8} {'trim ms':>8} {'grow tx':>8} {'trim tx':>8} {'lost ms':>8}")
    for r in results:
        print(f"{r['config']:<12} {r['batch_pages']:>5} {r['grow_ms']:>8.2f} {r['trim_ms']:>8.2f} "
              f"{r['grow_transactions']:>8.0f} {r['trim_transactions']:>8.0f} {r['lost_ms']:>8.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
