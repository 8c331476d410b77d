"""Worker ranks for the tensor-parallel tests, each a process of its own, and what starts and drives them.

A rank here is what ``serve_as_rank`` sets up in a vLLM worker: a host-backed
elastic KV cache (``tests/kv_fixtures.py``) and a :class:`~kvelastic.tp.rank.RankWorker`,
fed each step through the ``Worker.execute_model`` patch, whose forward pass
writes and checks the step's blocks on this rank's shard. Steps reach a rank
over a pipe as vLLM's broadcast would carry them; it answers with what its
``execute_model`` returned (its report, on a report step), which
:class:`RankProcesses` merges as vLLM's executor does. The ranks that Ray's V2
executor drives (:func:`ray_rank_main`) answer vLLM's ``collective_rpc`` calls
instead, as vLLM's ``WorkerProc`` does.

This module imports neither vLLM nor a test module that does, so a rank process
imports only torch and kvelastic. Ranks start from a forkserver that imported
this module (torch with it) once, so each rank forks ready instead of importing
torch anew. Nothing depends on a rank's parent: a rank meets its scheduler only
on the calls it is sent.
"""

from __future__ import annotations

import multiprocessing
import threading
import types
from typing import Any, Sequence

from kvelastic.tp.protocol import MAP, StepPlan
from kvelastic.tp.rank_info import RankInfo, decode_info
from kvelastic.tp.report_merger import ReportMerger, step_report_of
from kvelastic.tp.step_report import StepReport
from tests.kv_fixtures import LAYERS, PAGE, N, NamedHostBackend, build_cache

RANK_START_S = 240  # a loaded 2-core machine: a rank that forks ready still builds its cache and threads
REPLY_S = 30

_context: Any = None


def rank_context() -> Any:
    """The forkserver context every rank starts from, its server preloaded with this module (and torch)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([__name__])
    return _context


class MapOrder:
    """Watches a rank's cache: each map the step thread makes, and which step's forward had been launched.

    The forward stand-in sets ``launched``; a map of a MAP command of step N's plan made while
    ``launched`` is still below N ran in front of that step's forward pass."""

    def __init__(self, cache) -> None:
        self.launched = 0
        self.calls: list[tuple[tuple[int, ...], int]] = []
        inner = cache.map_as_many

        def map_as_many(groups, **kw):
            if threading.current_thread() is threading.main_thread():  # not the idle thread's maps
                self.calls.append((tuple(groups), self.launched))
            return inner(groups, **kw)

        cache.map_as_many = map_as_many

    def take(self, plan) -> tuple[int, int]:
        """How many of ``plan``'s MAPs ran before its forward's launch and after it; forgets the calls."""
        own = {tuple(c[2]) for c in plan.commands if c[1] == MAP}
        mine = [launched for groups, launched in self.calls if groups in own]
        self.calls = []
        return sum(launched < plan.step for launched in mine), sum(launched == plan.step for launched in mine)


def rank_main(conn, rank: int, world: int, limit_groups: int | None, cpu_bytes: int | None, layers: int = LAYERS,
              shape: tuple[int, int] = (N, PAGE), device: str | None = None, start_groups: Sequence[int] = (),
              host_slots: int = 0) -> None:
    """A worker rank: each step goes through the ``Worker.execute_model`` patch, whose forward pass here
    does the step's writes and checks on this rank's shard (at once: as if the GPU ran it on launch).

    ``shape``: the cache's blocks and page bytes (see ``build_cache``); ``device``: the name its host-memory
    "device" goes by (ranks on different GPUs name different ones); ``start_groups``: groups it maps before it
    serves (as vLLM's start-up may); ``host_slots``: its share of a host tier, pinned chunk by chunk as the
    test says (``("pin", chunks, slots)``: answered once at least ``slots`` are pinned), the driver's pinning
    being the one thing stood in for (:mod:`tests.host_pins`)."""
    from kvelastic.tp import rank_handover
    from kvelastic.tp.worker_side import start_rank
    from patches.worker_execute_model import _execute
    from tests.host_pins import GatedHostShare

    backend = NamedHostBackend(device) if device else None
    pool, views, cache = build_cache(limit_groups, backend=backend, layers=layers, num_blocks=shape[0],
                                     page_bytes=shape[1])
    cache.map_groups(start_groups)
    gate = GatedHostShare() if host_slots else None
    if gate is not None:
        cpu_bytes = gate.cpu_bytes(cache, host_slots, world)
    order = MapOrder(cache)
    worker = start_rank(cache, rank, world, None, cpu_bytes)
    runtime = types.SimpleNamespace(rank_worker=worker)
    conn.send(("ready", rank_handover.describe(None)))  # what the engine core asks each rank for
    while True:
        message = conn.recv()
        if message == "stop":
            break
        if message[0] == "pin":
            conn.send(("pinned", gate.pin(message[1], message[2])))
            continue
        plan, writes, checks = message

        def forward(_scheduler_output) -> None:
            order.launched = plan.step
            for block_id, value in writes:
                assert pool.is_mapped(cache.group_of_block(block_id)), f"write to unmapped block {block_id}"
                for view in views:
                    view[:, block_id].fill_(value + rank)
            for block_id, value in checks:
                assert pool.is_mapped(cache.group_of_block(block_id)), f"read of unmapped block {block_id}"
                for view in views:
                    assert bool((view[:, block_id] == value + rank).all()), f"block {block_id} lost its data"
            return None  # vLLM's "forward launched"

        try:
            # a report step's execute_model reply carries the report; None otherwise
            launched = _execute(runtime, forward, None, (types.SimpleNamespace(kvelastic_plan=plan),), {})
            conn.send(("ok", pool.stats().mapped_bytes, launched, (*order.take(plan), worker.maps_kept_in_order)))
        except AssertionError as exc:
            conn.send(("error", str(exc), None, None))
    if gate is not None:
        gate.open()
    worker.close()
    pool.close()
    conn.send("closed")


class SampledOutput:
    """A ``sample_tokens`` output where no model runs: only what the executor's merge sets on it matters."""


def merge_replies(plan: StepPlan, replies: Sequence[Any]) -> StepReport | None:
    """The ranks' ``execute_model`` replies to ``plan`` as vLLM's executor merges a report step's two calls
    (``execute_model``, then ``sample_tokens``, one merger): the report that reaches the scheduler, or None
    unless ``plan`` asked for reports (then no rank may have sent one)."""
    if not plan.report:
        assert all(reply is None for reply in replies), "a rank replied to a step that asked no report"
        return None
    if not replies:
        return None
    merger = ReportMerger()
    assert merger.aggregate(list(replies), output_rank=0) is None  # "forward launched", as vLLM expects
    return step_report_of(merger.aggregate([SampledOutput() for _ in replies], output_rank=0))


class RankProcesses:
    """The ranks, each in its own process; each step reaches them as vLLM's broadcast would carry it."""

    def __init__(self, limits: Sequence[int | None] | None = None, cpu_bytes: int | None = None,
                 layers: Sequence[int] = (LAYERS, LAYERS), shape: tuple[int, int] = (N, PAGE),
                 devices: Sequence[str] | None = None, start_groups: Sequence[Sequence[int]] | None = None,
                 host_slots: int = 0):
        """``layers``: each rank's KV layers (equal under TP; a pipeline stage's own under PP), one entry
        per rank; ``shape``: every rank's blocks and page bytes; ``devices``: each rank's device name
        (default: all on the one host-memory device); ``limits``, ``start_groups``: per rank;
        ``host_slots``: each rank's gated host share (:meth:`pin`)."""
        ctx = rank_context()
        self.world = len(layers)
        limits = limits or (None,) * self.world
        start_groups = start_groups or ((),) * self.world
        self.conns, self.procs = [], []
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(child, rank, self.world, limits[rank], cpu_bytes, layers[rank],
                                                       shape, devices[rank] if devices else None, start_groups[rank],
                                                       host_slots), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        described = []
        for rank, conn in enumerate(self.conns):
            assert conn.poll(RANK_START_S), f"rank {rank} did not start"
            tag, data = conn.recv()
            assert tag == "ready" and data is not None, (tag, data)
            described.append(decode_info(data, f"rank {rank}'s description"))
        self.infos: list[RankInfo] = described  # what the engine core's executor brings back from each rank
        self.mapped_bytes = [0] * self.world
        self.launched: dict[int, Any] = {}  # the last step's execute_model replies, by rank (reports on a report step)
        self.maps_before_launch = 0  # the plans' MAPs every rank ran in front of their step's forward
        self.maps_after_launch = 0   # ... and behind its launch
        self.maps_kept_in_order = [0] * self.world  # MAPs a later command of their plan touched (each rank)

    def send(self, plan: StepPlan, writes=(), checks=(), live=None) -> list:
        """One step: the plan and the forward pass's writes and checks; returns each rank's mapped bytes."""
        ranks = range(self.world) if live is None else live
        for r in ranks:
            self.conns[r].send((plan, list(writes), list(checks)))
        replies, self.launched = [], {}
        for r in ranks:
            assert self.conns[r].poll(REPLY_S), f"rank {r} did not answer"
            status, value, launched, order = self.conns[r].recv()
            assert status == "ok", f"rank {r}: {value}"
            self.maps_before_launch += order[0]
            self.maps_after_launch += order[1]
            self.maps_kept_in_order[r] = order[2]
            self.mapped_bytes[r] = value
            replies.append(value)
            self.launched[r] = launched
        return replies

    def merged_report(self, plan: StepPlan, deliver: Sequence[int] | None = None) -> StepReport | None:
        """The last step's replies merged as vLLM's executor merges them (:func:`merge_replies`). ``deliver``:
        the ranks whose replies reach the merger (default: every rank that ran the step)."""
        ranks = sorted(self.launched) if deliver is None else list(deliver)
        return merge_replies(plan, [self.launched[r] for r in ranks])

    def pin(self, rank: int, chunks: int, slots: int) -> tuple[int, bool]:
        """Let rank ``rank`` pin ``chunks`` more chunks of its host share; (ready, settled) once ``slots`` are."""
        self.conns[rank].send(("pin", chunks, slots))
        assert self.conns[rank].poll(150), f"rank {rank} did not pin"
        tag, state = self.conns[rank].recv()
        assert tag == "pinned"
        return state

    def check_map_order(self) -> None:
        """Every plan's MAPs ran behind their step's forward launch, and none had to stay in front of it
        because a later command of its plan touched its groups (the scheduler never sends that)."""
        assert self.maps_kept_in_order == [0] * self.world, "a plan touched the groups of its own MAP"
        assert self.maps_before_launch == 0, "a MAP ran in front of its step's forward pass"

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                conn.send("stop")
                conn.poll(10)
            proc.join(10)


# ------------------------------------------------------------------ ranks of Ray's V2 executor
class RayWorker:
    """What a rank's vLLM worker does with the executor's calls: make its KV cache (once its engine core said it
    drives it, as ``serve_as_rank`` checks), then run each step through the ``Worker.execute_model`` wrap, whose
    forward pass writes the step's blocks (each must be mapped)."""

    def __init__(self, rank: int, world: int, start_groups: Sequence[int], backend: str = "ray") -> None:
        self.rank, self.world, self.start_groups, self.backend = rank, world, start_groups, backend
        self.runtime = types.SimpleNamespace(rank_worker=None)
        self.pool = self.views = self.cache = None

    def initialize_from_config(self, *_) -> None:
        from kvelastic.tp import rank_handover
        from kvelastic.tp.worker_side import start_rank

        rank_handover.engine_core(self.backend)  # under Ray: EngineCoreUnknown unless the engine core said so
        self.pool, self.views, self.cache = build_cache()
        self.cache.map_groups(self.start_groups)  # as vLLM's start-up may, before the scheduler exists
        self.runtime.rank_worker = start_rank(self.cache, self.rank, self.world, None, None)

    def compile_or_warm_up_model(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(language_model=0.0, encoder=0.0)

    def execute_model(self, scheduler_output) -> object:
        from patches.worker_execute_model import _execute

        def forward(_scheduler_output) -> None:  # "launched": the step's writes, on this rank's shard
            for block_id in scheduler_output.writes:
                assert self.pool.is_mapped(self.cache.group_of_block(block_id)), f"write to unmapped {block_id}"
                for view in self.views:
                    view[:, block_id].fill_(self.rank + 1)

        return _execute(self.runtime, forward, self, (scheduler_output,), {})

    def sample_tokens(self, _grammar_output) -> types.SimpleNamespace:
        return types.SimpleNamespace(rank=self.rank)  # the step's output (only the output rank's reaches the engine)

    def close(self) -> None:
        if self.runtime.rank_worker is not None:
            self.runtime.rank_worker.close()
            self.pool.close()


def _run_method(worker: Any, method: Any, args: tuple, kwargs: dict) -> Any:
    """What vLLM's worker does with a call: a name is the worker's method, bytes a pickled callable that takes
    the worker first. ``vllm.v1.serial_utils.run_method`` itself where a test asks for it (importing it imports
    most of vLLM)."""
    if isinstance(method, str):
        return getattr(worker, method)(*args, **kwargs)
    import cloudpickle

    return cloudpickle.loads(method)(worker, *args, **kwargs)


def ray_rank_main(rank: int, world: int, inbox, outbox, host: str | None = None, start_groups: Sequence[int] = (),
                  vllm_run_method: bool = False, backend: str = "ray") -> None:
    """Answer the executor's calls as vLLM's WorkerProc does: run the call on the worker, then ("ok", result)
    or ("failed", the error), sent only by the rank the call asks to reply (every rank if none). ``host``: the
    host identity this rank reads for its own (another host's, for the tests of one), at the one place a rank
    learns where it runs; ``vllm_run_method``: run each call through vLLM's own ``run_method``; ``backend``:
    the executor the rank believes it serves (``mp``: its engine core needs no word)."""
    from kvelastic.tp import rank_handover

    run = _run_method
    if vllm_run_method:
        from vllm.v1.serial_utils import run_method as run
    if host is not None:
        rank_handover.host_identity = lambda: host
    worker = RayWorker(rank, world, start_groups, backend)
    while True:
        item = inbox.recv()
        if item is None:
            worker.close()
            return
        method, args, kwargs, reply_rank = item
        try:
            answer = ("ok", run(worker, method, args, kwargs))
        except Exception as error:  # noqa: BLE001 - sent back, as vLLM's worker does
            answer = ("failed", f"{type(error).__name__}: {error}")
        if reply_rank is None or reply_rank == rank:
            outbox.send(answer)
