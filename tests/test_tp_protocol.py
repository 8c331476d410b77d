"""One scheduler, two worker ranks in separate processes, host-backed pools: the TP protocol.

The scheduler side is the real one (vLLM's BlockPool made page-aware over a
:class:`ShardedKVCache` and a :class:`RemoteMapper`); each rank is a spawned
process with its own pool and :class:`RankWorker`. Steps travel over a pipe as
vLLM's broadcast would carry them: the plan, then the blocks the "forward pass"
writes and reads. Every rank checks that each block it touches is mapped and
holds what was written, so a block handed out before every rank mapped it, or
unmapped while still in use, fails the test.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import types

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from kvelastic.hooks.block_pool import make_page_aware  # noqa: E402
from kvelastic.tp import board as shm  # noqa: E402
from kvelastic.tp.protocol import MAP  # noqa: E402
from kvelastic.tp.scheduler_side import RankConnection  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP, BS, GROUP_BYTES, N, PAGE, StandInRequest  # noqa: E402
from tests.scheduler_harness import scheduler_patcher  # noqa: E402

WORLD = 2
CPU_BYTES = 1 << 20
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
    from tests.kv_fixtures import NamedHostBackend, build_cache

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
        """vLLM's check, then its allocation; None is a scheduling miss (demand is recorded)."""
        if n > self.bp.get_num_free_blocks():
            self.queue.want_blocks(n)
            return None
        return self.bp.get_new_blocks(n)



@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(**kw):
        made.append(Cluster(tmp_path, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def allocate_within(c: Cluster, n: int, steps: int = 5) -> list:
    """Allocate ``n`` blocks, running empty steps while the ranks map what the scheduler asked for."""
    for _ in range(steps):
        blocks = c.allocate(n)
        if blocks is not None:
            return blocks
        c.step()
    raise AssertionError(f"{n} blocks never became available")


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_blocks_are_handed_out_only_once_every_rank_mapped_them(cluster, split):
    layers = RANK_LAYERS[split]
    c = cluster(layers=layers)
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None  # nothing confirmed yet: a scheduling miss
    assert c.mapper.pending_commands, "the miss must turn into map commands for the next step"
    blocks = allocate_within(c, 3 * BLOCKS_PER_GROUP)
    groups = {c.cache.group_of_block(b.block_id) for b in blocks}
    for board in c.mapper.boards:
        assert all(board.groups[g] > 0 for g in groups)
    c.step(writes=[(b.block_id, 7) for b in blocks])
    c.step(checks=[(b.block_id, 7) for b in blocks])  # every rank still holds what its layers wrote
    assert all(m >= 3 * group_bytes(n) for m, n in zip(c.mapped_bytes, layers))


def test_freed_groups_are_unmapped_on_every_rank_with_the_next_step(cluster):
    c = cluster()
    blocks = allocate_within(c, 4 * BLOCKS_PER_GROUP)
    c.step(writes=[(b.block_id, 3) for b in blocks])
    peak = list(c.mapped_bytes)
    c.bp.free_blocks(blocks)
    c.queue.set_idle()
    c.step()
    assert all(after < before for after, before in zip(c.mapped_bytes, peak))
    assert c.mapped_bytes[0] == c.mapped_bytes[1]


def test_commands_reach_idle_ranks_without_a_step_but_never_overtake_one(cluster):
    c = cluster()
    blocks = allocate_within(c, 2 * BLOCKS_PER_GROUP)
    plan = c.mapper.take_plan()  # a step is sent but the ranks have not run it yet
    c.bp.free_blocks(blocks)
    c.queue.set_idle()
    assert not c.mapper.deliver_idle(), "an unmap must wait while a step that may use the group is in flight"
    for conn in c.conns:
        conn.send((plan, [(b.block_id, 1) for b in blocks], []))
    for conn in c.conns:
        assert conn.recv()[0] == "ok"
    c.queue.set_idle()  # the reclaimer's next tick: groups mapped ahead by that step are surplus too
    assert c.mapper.deliver_idle()
    assert wait_for(lambda: all(b.get(shm.HELD_BYTES) <= GROUP_BYTES for b in c.mapper.boards)), \
        "idle ranks kept their pages (mapped, or warm in their reserve)"


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_ranks_keep_the_warm_reserve_the_reclaimer_asks_for(cluster):
    c = cluster()
    c.step()  # the null group and one group mapped ahead
    baseline = [b.get(shm.HELD_BYTES) for b in c.mapper.boards]
    pages = 2 * GROUP_BYTES // c.cache.pool.page_bytes
    c.cache.pool.grow_reserve(pages)
    assert c.cache.pool.stats().reserve_bytes == 2 * GROUP_BYTES
    c.step()
    assert wait_for(lambda: [b.get(shm.HELD_BYTES) for b in c.mapper.boards]
                    == [v + 2 * GROUP_BYTES for v in baseline]), "the ranks did not build the warm reserve"
    c.cache.pool.trim_reserve(0)
    c.step()
    assert [b.get(shm.HELD_BYTES) for b in c.mapper.boards] == baseline


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_a_rank_out_of_memory_turns_into_a_scheduling_miss(cluster, split):
    layers = RANK_LAYERS[split]
    c = cluster(limits=(None, 3), layers=layers)  # rank 1's GPU has room for 3 groups (the null group included)
    got = allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None
    c.step()  # rank 0 maps the extra groups, rank 1 refuses them
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None, "a group refused by one rank must not be handed out"
    assert c.mapper.pending_commands, "the groups rank 0 did map must be given back"
    c.step()
    assert c.mapped_bytes == [3 * group_bytes(n) for n in layers]
    c.step(writes=[(b.block_id, 5) for b in got], checks=[])
    c.bp.free_blocks(got)
    assert allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)  # the engine keeps serving within what fits


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_a_dead_rank_is_noticed_and_never_waited_for(cluster, split):
    c = cluster(layers=RANK_LAYERS[split])
    allocate_within(c, BLOCKS_PER_GROUP)
    os.kill(c.procs[1].pid, signal.SIGKILL)
    c.procs[1].join(10)
    c.mapper._next_liveness = 0.0
    started = time.monotonic()
    assert c.allocate(6 * BLOCKS_PER_GROUP) is None
    c.step(live=[0])
    c.mapper._next_liveness = 0.0
    assert c.allocate(6 * BLOCKS_PER_GROUP) is None
    assert c.mapper.dead_ranks == {1}
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_a_slow_rank_delays_its_groups_and_holds_up_nothing_else(cluster, split):
    """Rank 1 runs a step behind: the groups it has not mapped yet are not handed out, the scheduler
    side never waits for it, and once it catches up the same groups are adopted."""
    layers = RANK_LAYERS[split]
    c = cluster(layers=layers)
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None
    plan = c.mapper.take_plan()
    c.send(plan, live=[0])  # rank 0 maps; rank 1 has not got to this step yet
    started = time.monotonic()
    for _ in range(20):  # vLLM asks for free blocks many times a step: never waits for rank 1
        assert c.allocate(3 * BLOCKS_PER_GROUP) is None, "a group only rank 0 mapped was handed out"
    assert time.monotonic() - started < 1.0
    assert c.mapper.pending_groups >= 3 and c.mapped_bytes[0] >= 3 * group_bytes(layers[0])
    c.send(plan, live=[1])  # rank 1 catches up with the same step
    blocks = c.allocate(3 * BLOCKS_PER_GROUP)
    assert blocks is not None, "the groups both ranks mapped must be adopted"
    c.step(writes=[(b.block_id, 9) for b in blocks])
    c.step(checks=[(b.block_id, 9) for b in blocks])  # both ranks hold the data their layers wrote


def test_pipeline_stages_count_each_group_at_the_larger_stage_and_a_slot_holds_both_shares(cluster):
    layers = RANK_LAYERS["pipeline"]
    c = cluster(cpu_bytes=CPU_BYTES, layers=layers)
    assert c.cache.group_bytes == group_bytes(max(layers))
    infos = [shm.read_info(c.folder, r) for r in range(WORLD)]
    assert [i.group_bytes for i in infos] == [group_bytes(n) for n in layers]
    assert c.connection.slot_bytes == sum(i.slot_bytes for i in infos)
    assert c.connection.host_slots == min(i.host_slots for i in infos) > 0


def test_spilled_blocks_come_back_on_every_rank(cluster):
    from kvelastic.hooks.offload_setup import wire_offload
    from kvelastic.settings import Settings

    c = cluster(cpu_bytes=CPU_BYTES)
    tier, copier = c.connection.host_tier(Settings(cpu_bytes=CPU_BYTES))
    manager = wire_offload(c.bp, c.queue, tier, copier, scheduler_patcher())
    assert manager.tier.stats().slots == c.connection.host_slots > 0
    allocate_within(c, BLOCKS_PER_GROUP - 1)  # fills the null block's group, which is never released
    blocks = allocate_within(c, BLOCKS_PER_GROUP)
    c.step(writes=[(b.block_id, 40 + i % 50) for i, b in enumerate(blocks)])
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(len(blocks))]
    c.bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, len(blocks), BS, 0)
    c.bp.free_blocks(blocks)
    assert c.queue.reclaim_cached(groups_wanted=8) >= 1  # spill, then unmap, in that order on each rank
    c.queue.set_idle()
    c.step()
    assert manager.counters.spilled_blocks == len(blocks)
    assert all(c.mapped_bytes[r] == c.mapper.boards[r].get(shm.MAPPED_BYTES) for r in range(WORLD))
    c.queue.want_blocks(len(blocks))  # free mapped blocks to load into
    c.step()
    found = [c.bp.get_cached_block(h, [0]) for h in hashes]  # host-tier hits become GPU blocks
    assert all(f is not None for f in found)
    manager.flush()
    new_ids = [f[0].block_id for f in found]
    assert len(set(new_ids)) == len(new_ids)
    steps = 0
    while not all(c.cache.group_of_block(b) in c.mapper.mapped_groups for b in new_ids) and steps < 5:
        c.step()
        steps += 1
    c.step(checks=[(b, 40 + i % 50) for i, b in enumerate(new_ids)])
    assert manager.counters.reloaded_blocks == len(blocks)


def test_the_engine_folder_is_unique_to_the_process_not_just_its_pid(tmp_path):
    from kvelastic.cluster.liveness import process_start_time

    from kvelastic.cluster.liveness import own_pid_namespace

    here = shm.engine_dir(os.getpid(), tmp_path)
    assert here == shm.engine_dir(os.getpid(), tmp_path)
    assert here.parent == tmp_path / f"kvelastic-u{os.geteuid()}"  # this user's folder: nobody else writes there
    assert here.name == f"engine-{own_pid_namespace()}-{os.getpid()}-{process_start_time()}"
    assert process_start_time() > 0  # Linux: a reused pid would carry another start time


def test_groups_mapped_for_waiting_requests_are_not_released_before_they_are_used(cluster):
    c = cluster()
    c.queue.want_blocks(4 * BLOCKS_PER_GROUP)  # a waiting request needs four groups more
    c.step()
    c.allocate(2)  # a small allocation (a decoding request) first: the queue re-sizes its prefetch
    assert c.bp.get_num_free_blocks() >= 4 * BLOCKS_PER_GROUP, "groups mapped for the request were released"
    assert c.allocate(4 * BLOCKS_PER_GROUP) is not None


def test_write_through_stores_on_every_rank_and_a_reuse_sends_one_wait(cluster):
    from kvelastic.hooks.offload_setup import wire_offload
    from kvelastic.settings import Settings
    from kvelastic.tp.protocol import STORE, WAIT

    c = cluster(cpu_bytes=CPU_BYTES)
    settings = Settings(cpu_bytes=CPU_BYTES, cpu_store="write-through")
    tier, copier = c.connection.host_tier(settings)
    manager = wire_offload(c.bp, c.queue, tier, copier, scheduler_patcher(), settings)
    allocate_within(c, BLOCKS_PER_GROUP - 1)  # fills the null block's group, which is never released
    blocks = allocate_within(c, BLOCKS_PER_GROUP)
    hashes = [hashlib.sha256(b"wt%d" % i).digest() for i in range(len(blocks))]
    c.bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, len(blocks), BS, 0)  # named in this step
    manager.end_step()
    c.step(writes=[(b.block_id, 60 + i % 30) for i, b in enumerate(blocks)])  # whose forward computes them
    plans = []
    for _ in range(2):
        manager.end_step()
        plans.append(c.mapper.take_plan())
        c.send(plans[-1])
    kinds = [[cmd[1] for cmd in p.commands] for p in plans]
    assert kinds[0] == [] and kinds[1] == [STORE] and plans[1].commands[0][4] is False  # beside compute
    c.bp.free_blocks(blocks)
    assert c.queue.reclaim_cached(groups_wanted=8) >= 1  # released: the copies made ahead are promoted
    assert manager.counters.evicted_free == len(blocks) and manager.counters.spilled_blocks == 0
    manager.end_step()
    plan = c.mapper.take_plan()
    assert STORE not in [cmd[1] for cmd in plan.commands]  # the unmap needs no copy: the rank orders the store
    c.send(plan)
    c.queue.want_blocks(len(blocks))
    c.step()
    found = [c.bp.get_cached_block(h, [0]) for h in hashes]
    assert all(f is not None for f in found)
    manager.end_step()
    new_ids = [f[0].block_id for f in found]
    for _ in range(5):
        if all(c.cache.group_of_block(b) in c.mapper.mapped_groups for b in new_ids):
            break
        c.step()
    c.step(checks=[(b, 60 + i % 30) for i, b in enumerate(new_ids)])  # every rank's shard came back
    # A block reused while the scheduler cannot know its store passed: one WAIT, no second copy.
    more = allocate_within(c, 4)
    more_hashes = [hashlib.sha256(b"more%d" % i).digest() for i in range(4)]
    c.bp.cache_full_blocks(StandInRequest(more_hashes), more, 0, 4, BS, 0)
    for _ in range(3):
        manager.end_step()
        c.step()
    c.bp.free_blocks(more)
    manager.spill(more, before_reuse=True)  # as popleft_n does when it evicts them for reuse
    manager.end_step()
    plan = c.mapper.take_plan()
    kinds = [cmd[1] for cmd in plan.commands]
    assert kinds.count(WAIT) == 1 and STORE not in kinds
    c.send(plan)  # every rank applies it before its forward pass
