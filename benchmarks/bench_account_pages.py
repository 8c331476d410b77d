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

Each configuration runs alone and then beside a thread running pure Python back to back (as
vLLM's busy loop does while it schedules): a transaction is Python under the GIL between system
calls that release it, and each of those must win the GIL back (``bench_gil_convoy.py``)::

    python benchmarks/bench_account_pages.py --json /tmp/account_pages.json
    python benchmarks/bench_account_pages.py --backend cuda --json $OUT/account_pages.json   # on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from typing import Any, Callable

from kvelastic.cluster import SharedAccount, SharedBudgetSource
from kvelastic.pool import DeviceSource, LimitedSource, PagePool, ReserveSource, StatisticsSource
from kvelastic.pool.sources import BATCH_BYTES
from pool_bench_parts import PythonBusy, backend_for, print_table, write_json  # beside this file

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


def timed_ms(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def run_config(name: str, beside: bool, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """One configuration's reps: grow then trim, timed, with the account's transactions counted;
    ``beside``: with a thread running Python meanwhile."""
    page = args.page_mib * MIB
    pages = args.grow_mib * MIB // page
    batch = page if name == "page-a-call" else BATCH_BYTES
    backend = backend_for(args.backend)
    budget = SharedBudgetSource(StatisticsSource(DeviceSource(backend, page)))
    pool = PagePool(backend, ReserveSource(LimitedSource(budget), batch_bytes=batch), park=False)
    rows: dict[str, list[float]] = {"grow_ms": [], "trim_ms": [], "grow_transactions": [], "trim_transactions": []}
    with ExitStack() as stack:
        counter = None
        if name != "no-account":
            account = stack.enter_context(SharedAccount.open(f"bench-{name}-{beside}", 1 << 40, directory=directory,
                                                             lock_timeout_s=ENGINE_LOCK_TIMEOUT_S))
            member = stack.enter_context(account.join(name))
            budget.attach(member)
            counter = TransactionCount(account)
        if beside:
            stack.enter_context(PythonBusy())
        for _ in range(args.reps):
            before = counter.count if counter else 0
            rows["grow_ms"].append(timed_ms(lambda: pool.grow_reserve(pages)))
            middle = counter.count if counter else 0
            rows["trim_ms"].append(timed_ms(lambda: pool.trim_reserve(0)))
            after = counter.count if counter else 0
            rows["grow_transactions"].append(middle - before)
            rows["trim_transactions"].append(after - middle)
            assert pool.stats().held_bytes == 0
        pool.close()
    return {"config": name, "beside": "python-busy" if beside else "alone", "pages": pages,
            "batch_pages": max(1, batch // page),
            **{key: statistics.median(values) for key, values in rows.items()}, "raw": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--page-mib", type=int, default=2, help="page size (KVELASTIC_CHUNK_SIZE)")
    parser.add_argument("--grow-mib", type=int, default=256, help="reserve grown and trimmed per rep")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvelastic-bench-") as directory:  # mode 0700
        os.environ["KVELASTIC_SHARED_DIR"] = directory  # the account's scope: a private directory of this run
        results = [run_config(name, beside, args, directory)
                   for beside in (False, True) for name in ("no-account", "page-a-call", "batched")]
    columns = [("config", "config", "<12"), ("beside", "beside", "<12"), ("batch", "batch_pages", ">5d"), ("grow ms", "grow_ms", ">8.2f"),
               ("trim ms", "trim_ms", ">8.2f"), ("grow tx", "grow_transactions", ">8.0f"),
               ("trim tx", "trim_transactions", ">8.0f")]
    print_table(f"{args.grow_mib} MiB of {args.page_mib} MiB pages on {args.backend}; medians of {args.reps} reps",
                columns, results)
    write_json(args.json, args, results)

if __name__ == "__main__":
    main()
