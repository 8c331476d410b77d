"""Worker ranks that time kvelastic's wrap of ``Worker.execute_model`` step by step (``bench_rank_step_cpu.py``).

Each rank is a spawned process with the tests' host-memory cache at the TP model's
size (``sched_cpu_tp.py``) and a real :class:`~kvelastic.tp.rank.RankWorker`, as the
tests' ranks are; the difference is what it measures. A step's plan arrives pickled,
as vLLM's broadcast carries the ``SchedulerOutput`` it rides on. The rank unpickles it
(timed), then calls the patch's wrapper (:func:`patches.worker_execute_model._execute`,
through ``wrapt`` as the patcher installs it) around a forward pass that does nothing,
and the bare forward alone: the difference, in the main thread's CPU and wall time, is
what kvelastic adds to the step on that rank. The time inside the pool's maps and unmaps
(driver calls on a GPU, host ``mmap`` here) is kept apart, as is the CPU the rank's idle
thread takes meanwhile (it shares the GIL with the step).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import threading
import time
import types
from typing import Any

RANK_START_S = 240
_DONE = "stop"


def _timed_pool(cache: Any, spent: list[float]) -> None:
    """Add the main thread's CPU inside the cache's map and unmap calls to ``spent[0]`` (the idle thread's
    maps of idle commands are not the step's)."""
    for name in ("map_as_many", "unmap_groups"):
        inner = getattr(cache, name)

        def timed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return _inner(*args, **kwargs)
            start = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start

        setattr(cache, name, timed)


def _one_step(wrapper: Any, forward: Any, blob: bytes, spent: list[float], profiler: Any) -> tuple[tuple, Any]:
    """One step on this rank: (step, commands, maps, unpickle s, wrap CPU s, wrap wall s, bare CPU s, pool CPU s),
    and the wrap's reply (the rank's report on a report step)."""
    c0 = time.thread_time()
    plan = pickle.loads(blob)
    unpickle = time.thread_time() - c0
    output = types.SimpleNamespace(kvelastic_plan=plan)
    spent[0] = 0.0
    if profiler is not None:
        profiler.enable()
    w0, c0 = time.perf_counter(), time.thread_time()
    reply = wrapper(output)
    c1, w1 = time.thread_time(), time.perf_counter()
    if profiler is not None:
        profiler.disable()
    forward(output)
    bare = time.thread_time() - c1
    maps = sum(1 for c in plan.commands if c[1] == "map")
    return (plan.step, len(plan.commands), maps, unpickle, c1 - c0, w1 - w0, bare, spent[0]), reply


def rank_main(conn: Any, rank: int, world: int, shape: tuple[int, int], profile: str | None) -> None:
    """A rank: the cache, the worker, then steps until told to stop; replies with its records."""
    import cProfile

    import wrapt

    from kvelastic.tp import rank_handover
    from kvelastic.tp.worker_side import start_rank
    from patches.worker_execute_model import _execute
    from tests.kv_fixtures import build_cache

    pool, _views, cache = build_cache(None, layers=3, num_blocks=shape[0], page_bytes=shape[1])
    spent = [0.0]
    _timed_pool(cache, spent)
    worker = start_rank(cache, rank, world, None, None)
    runtime = types.SimpleNamespace(rank_worker=worker)

    def forward(scheduler_output: Any) -> None:
        return None  # vLLM's "forward launched"

    wrapper = wrapt.FunctionWrapper(forward, functools.partial(_execute, runtime))
    profiler = cProfile.Profile() if profile else None
    conn.send(rank_handover.describe(None))  # what the engine core asks each rank for
    records, idle_clock = [], time.pthread_getcpuclockid(worker._thread.ident)
    idle0, wall0 = time.clock_gettime(idle_clock), time.perf_counter()
    while True:
        blob = conn.recv_bytes()
        if blob == _DONE.encode():
            break
        record, reply = _one_step(wrapper, forward, blob, spent, profiler)
        records.append(record)
        conn.send(reply)
    idle = time.clock_gettime(idle_clock) - idle0
    if profiler is not None:
        profiler.dump_stats(f"{profile}.rank{rank}")
    conn.send({"rank": rank, "records": records, "idle_cpu_s": idle, "wall_s": time.perf_counter() - wall0})
    worker.close()
    pool.close()


class TimingRanks:
    """``world`` timing ranks; :meth:`send` is one step, :meth:`close` collects what they timed.

    Drop-in for the tests' ``RankProcesses`` where ``sched_cpu_tp.py`` sends plans (``send(plan)``, ``infos``,
    ``merged_report``)."""

    def __init__(self, world: int, shape: tuple[int, int], profile: str | None = None):
        ctx = mp.get_context("spawn")
        self.world, self.conns, self.procs = world, [], []
        self.results: list[dict] = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(child, rank, world, shape, profile), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        from kvelastic.tp.rank_info import decode_info

        self.infos = []  # the ranks' descriptions, as the engine core's executor brings them back
        for rank, conn in enumerate(self.conns):
            assert conn.poll(RANK_START_S), "a timing rank did not start"
            self.infos.append(decode_info(conn.recv(), f"timing rank {rank}'s description"))
        self.replies: list[Any] = []

    def send(self, plan: Any, *_: Any) -> None:
        """One step: the plan, pickled once as the broadcast pickles it, to every rank; waits for all."""
        blob = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(blob)
        self.replies = []
        for rank, conn in enumerate(self.conns):
            assert conn.poll(60), f"timing rank {rank} did not answer"
            self.replies.append(conn.recv())

    def merged_report(self, plan: Any) -> Any:
        """The last step's replies merged as vLLM's executor merges them (None unless ``plan`` asked)."""
        from tests.tp_ranks import merge_replies

        return merge_replies(plan, self.replies)

    def close(self) -> None:
        """Stop the ranks; their records land in :attr:`results` (once)."""
        if self.results or not self.procs:
            return
        for conn in self.conns:
            conn.send_bytes(_DONE.encode())
        for conn in self.conns:
            if conn.poll(60):
                self.results.append(conn.recv())
        for proc in self.procs:
            proc.join(10)


def gil_model(world: int, shape: tuple[int, int], steps: int, forward_s: float = 0.002,
              gap_s: float = 0.008) -> dict[str, list[float]]:
    """What the rank's idle thread costs the worker's thread through the GIL, in this process.

    A rank of ``world`` with its idle thread running; the main thread plays vLLM's
    worker: ``forward_s`` of its own CPU per step (input preparation and launches hold
    the GIL), then ``gap_s`` spinning on ``sched_yield`` as vLLM's broadcast reader does
    while the GPU computes. Per step, the wall time from the step's arrival to the end of
    its CPU work, less that work: first with the idle thread, then with it stopped.
    """
    from kvelastic.tp.worker_side import start_rank
    from tests.kv_fixtures import build_cache

    pool, _views, cache = build_cache(None, layers=3, num_blocks=shape[0], page_bytes=shape[1])
    worker = start_rank(cache, 0, world, None, None)
    time.sleep(0.5)
    lost = {"idle thread on": _gil_steps(steps, forward_s, gap_s)}
    worker.close()
    lost["idle thread off"] = _gil_steps(steps, forward_s, gap_s)
    pool.close()
    return lost


def _gil_steps(steps: int, forward_s: float, gap_s: float) -> list[float]:
    lost, arrive = [], time.perf_counter()
    for _ in range(steps):
        done = time.thread_time() + forward_s
        while time.thread_time() < done:
            pass
        lost.append(time.perf_counter() - arrive - forward_s)
        arrive = time.perf_counter() + gap_s
        while time.perf_counter() < arrive:
            os.sched_yield()  # releases the GIL, as vLLM's reader does between polls
    return lost
