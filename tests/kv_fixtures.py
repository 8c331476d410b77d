"""A small host-backed KV cache shaped like vLLM's FlashAttention layout, shared by the tests.

Three layers of (2, N, 16, 2, 32) bf16 views: each block has a K half and a V
half of 2 KiB per layer; 64 KiB pages hold 32 blocks, so a group is 6 pages.

Below them, the worker ranks of the TP tests: each a spawned process with such
a cache and a :class:`~kvelastic.tp.rank.RankWorker`, fed steps over a pipe as
vLLM's broadcast would carry them (:class:`RankProcesses`), and the scheduler
side in front of them (:class:`Cluster`, the ``cluster`` fixture).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import types

import pytest
import torch

from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.pool.kv_layout import KVGroupLayout, merge_runs, runs_of_view
from kvelastic.pool import HostBackend, PagePool
from kvelastic.pool.sources import DeviceSource, LimitedSource, ReserveSource
from kvelastic.pool.stats import StatisticsSource
from kvelastic.tp.protocol import MAP

N, BS, H, D, LAYERS = 256, 16, 2, 32, 3
HALF = BS * H * D * 2              # bytes of a block's K (or V) half in one layer
PAGE = 32 * HALF                   # 64 KiB pages: 32 blocks per group
BLOCKS_PER_GROUP = 32
GROUP_PAGES = 2 * LAYERS           # K and V page of every layer
GROUP_BYTES = GROUP_PAGES * PAGE


class Clock:
    """The real monotonic clock plus an offset a test moves (a queue's own stamps stay real)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class Engine(types.SimpleNamespace):
    """A test's pieces of one engine; never printed whole (a failure report would read KV views over
    unmapped pages)."""

    def __repr__(self) -> str:
        return "<Engine>"


class StandInRequest:
    """The one attribute ``BlockPool.cache_full_blocks`` reads from a request."""

    def __init__(self, hashes: list[bytes]):
        self.block_hashes = hashes


class NamedHostBackend(HostBackend):
    """Host memory that goes by another device name: a rank "on another GPU" names another account."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name


def build_cache(limit_groups: int | None = None, backend: HostBackend | None = None, wrap_device=None,
                layers: int = LAYERS, num_blocks: int = N, page_bytes: int = PAGE):
    """(pool, per-layer views, elastic cache) over the host backend (or ``backend``, a variant of it).

    ``wrap_device(source)`` inserts a layer above the device in the usual stack (the shared account's gate).
    ``layers``: how many KV layers this cache holds (a pipeline stage holds only its own).
    ``num_blocks``, ``page_bytes``: a larger cache, or larger groups (``page_bytes // HALF`` blocks each),
    shaped like a GPU engine's.
    """
    if wrap_device is None:
        pool = PagePool.standard(backend or HostBackend(), page_bytes=page_bytes)
    else:
        backend = backend or HostBackend()
        device = wrap_device(StatisticsSource(DeviceSource(backend, page_bytes)))
        pool = PagePool(backend, ReserveSource(LimitedSource(device)))
    raws = [pool.add_tensor(2 * num_blocks * HALF) for _ in range(layers)]
    views = [raw.view(torch.bfloat16).view(2, num_blocks, BS, H, D) for raw in raws]
    per_view = []
    for raw, view in zip(raws, views):
        region = pool.region_of(raw)
        per_view.append((region.region_id, *runs_of_view(view.shape, view.stride(), 2,
                                                          view.data_ptr() - region.address, num_blocks)))
    layout = KVGroupLayout(merge_runs(per_view), num_blocks, page_bytes)
    if limit_groups is not None:
        pool.set_limit(limit_groups * 2 * layers * page_bytes)
    return pool, views, ElasticKVCache(pool, layout)


def kv_cache_tensors(layers: list[str], num_blocks: int, page_bytes: int) -> list:
    """vLLM's ``KVCacheTensor`` entries for one group of ``layers``, in the installed release's declared shape.

    Up to 0.28 an entry per layer (``shared_by``); from 0.29 one backing that places the
    layers one after another (layer-outermost, as vLLM's planner lays out ``LBNHC``).
    """
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvelastic.patches.kv_cache_objects import KV_CACHE_TENSOR
    from kvelastic.patching.versions import installed_vllm_version

    if "shared_by" in KV_CACHE_TENSOR.shape(installed_vllm_version()).names:
        return [KVCacheTensor(size=num_blocks * page_bytes, shared_by=[layer]) for layer in layers]
    return [KVCacheTensor(size=len(layers) * num_blocks * page_bytes, layers=list(layers),
                          layer_stride=num_blocks * page_bytes, block_stride=page_bytes)]


# ------------------------------------------------------------------ worker ranks in spawned processes
WORLD = 2
#: Each rank's KV layers: tensor-parallel ranks hold the same ones; pipeline stages their own, so
#: their groups differ in bytes but not in blocks (the first stage the smaller: the scheduler must
#: not take its sizes for all).
RANK_LAYERS = {"tensor": (3, 3), "pipeline": (1, 2)}


def group_bytes(layers: int) -> int:
    """A group's bytes on a rank holding ``layers`` layers (a K and a V page each)."""
    return 2 * layers * PAGE


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


def rank_main(conn, folder: str, rank: int, limit_groups, cpu_bytes, layers: int = 3, shape=(N, PAGE),
              world: int = WORLD, device: str | None = None, map_after_launch: bool = True) -> None:
    """A worker rank: each step goes through the ``Worker.execute_model`` patch, whose forward pass here
    does the step's writes and checks on this rank's shard (at once: as if the GPU ran it on launch).

    ``shape``: the cache's blocks and page bytes (see ``build_cache``); ``device``: the name its
    host-memory "device" goes by (ranks on different GPUs name different ones)."""
    from pathlib import Path

    from kvelastic.tp.worker_side import start_rank
    from patches.worker_execute_model import _execute

    backend = NamedHostBackend(device) if device else None
    pool, views, cache = build_cache(limit_groups, backend=backend, layers=layers, num_blocks=shape[0],
                                     page_bytes=shape[1])
    order = MapOrder(cache)
    worker = start_rank(cache, Path(folder), rank, world, None, cpu_bytes, map_after_launch=map_after_launch)
    runtime = types.SimpleNamespace(rank_worker=worker)
    conn.send("ready")
    while True:
        message = conn.recv()
        if message == "stop":
            break
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
    worker.close()
    pool.close()
    conn.send("closed")


RANK_START_S = 240


class RankProcesses:
    """The ranks, spawned on ``folder``; each step reaches them as vLLM's broadcast would carry it."""

    def __init__(self, folder, limits=(None, None), cpu_bytes=None, layers=(3, 3), shape=(N, PAGE), devices=None,
                 map_after_launch: bool = True):
        """``layers``: each rank's KV layers (equal under TP; a pipeline stage's own under PP), one entry
        per rank; ``shape``: every rank's blocks and page bytes; ``devices``: each rank's device name
        (default: all on the one host-memory device); ``map_after_launch``: the ranks' setting."""
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.world = [], [], len(layers)
        self.map_after_launch = map_after_launch
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(child, str(folder), rank, limits[rank], cpu_bytes,
                                                       layers[rank], shape, self.world,
                                                       devices[rank] if devices else None, map_after_launch),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:  # a spawned rank imports torch and vLLM: minutes on a loaded 2-core machine
            assert conn.poll(RANK_START_S) and conn.recv() == "ready"
        self.mapped_bytes = [0] * self.world
        self.launched: list = []  # the last step's execute_model replies (reports on a report step)
        self.maps_before_launch = 0  # the plans' MAPs every rank ran in front of their step's forward
        self.maps_after_launch = 0   # ... and behind its launch
        self.maps_kept_in_order = [0] * self.world  # MAPs a later command of their plan touched (each rank)

    def send(self, plan, writes=(), checks=(), live=None) -> list:
        """One step: the plan and the forward pass's writes and checks; returns each rank's mapped bytes."""
        ranks = range(self.world) if live is None else live
        for r in ranks:
            self.conns[r].send((plan, list(writes), list(checks)))
        replies, self.launched = [], []
        for r in ranks:
            assert self.conns[r].poll(30), f"rank {r} did not answer"
            status, value, launched, order = self.conns[r].recv()
            assert status == "ok", f"rank {r}: {value}"
            self.maps_before_launch += order[0]
            self.maps_after_launch += order[1]
            self.maps_kept_in_order[r] = order[2]
            self.mapped_bytes[r] = value
            replies.append(value)
            self.launched.append(launched)
        return replies

    def check_map_order(self) -> None:
        """Every plan's MAPs ran where the ranks' setting puts them, and none had to stay in front of the
        forward because a later command of its plan touched its groups (the scheduler never sends that)."""
        assert self.maps_kept_in_order == [0] * self.world, "a plan touched the groups of its own MAP"
        if self.map_after_launch:
            assert self.maps_before_launch == 0, "a MAP ran in front of its step's forward pass"
        else:
            assert self.maps_after_launch == 0, "a MAP waited for the forward with the setting off"

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                conn.send("stop")
                conn.poll(10)
            proc.join(10)


class Cluster(RankProcesses):
    """The scheduler side plus two rank processes."""

    def __init__(self, tmp_path, limits=(None, None), cpu_bytes=None, layers=(3, 3), map_after_launch=True):
        from vllm.v1.core.block_pool import BlockPool

        from kvelastic.hooks.block_pool import make_page_aware
        from kvelastic.tp import board as shm
        from kvelastic.tp.scheduler_side import RankConnection
        from tests.scheduler_harness import scheduler_patcher

        self.folder = tmp_path / "engine"
        super().__init__(self.folder, limits, cpu_bytes, layers, map_after_launch=map_after_launch)
        self.connection = RankConnection(self.folder, [shm.read_info(self.folder, r) for r in range(WORLD)])
        self.cache, self.mapper = self.connection.cache, self.connection.mapper
        self.bp = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
        self.queue = make_page_aware(self.bp, self.cache, self.mapper, patcher=scheduler_patcher(),
                                     max_ahead_groups=2)

    def step(self, writes=(), checks=(), live=None) -> list:
        return self.send(self.mapper.take_plan(), writes, checks, live)

    def allocate(self, n: int) -> list | None:
        return allocate_or_ask(self.bp, self.queue, n)


def allocate_or_ask(bp, queue, n: int) -> list | None:
    """vLLM's check, then its allocation; None is a scheduling miss (the page-aware queue records the demand)."""
    if n > bp.get_num_free_blocks():
        queue.want_blocks(n)
        return None
    return bp.get_new_blocks(n)


def closed_after(make_one):
    """A fixture's body: yields a maker of harnesses (``make_one(**kw)``) and closes every one it made."""
    made = []

    def make(**kw):
        made.append(make_one(**kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster(tmp_path):
    yield from closed_after(lambda **kw: Cluster(tmp_path, **kw))


def allocate_within(c, n: int, steps: int = 5) -> list:
    """Allocate ``n`` blocks, running empty steps while the ranks map what the scheduler asked for."""
    for _ in range(steps):
        blocks = c.allocate(n)
        if blocks is not None:
            return blocks
        c.step()
    raise AssertionError(f"{n} blocks never became available")


def wait_for(condition, seconds: float = 10.0) -> bool:
    """Poll ``condition`` every 50 ms for up to ``seconds``; its last answer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
