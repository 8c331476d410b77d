"""Connect an engine's scheduler to worker ranks running in other processes.

Called by ``attach_scheduler`` when its process holds no KV cache: the ranks
(children of this engine-core process) have already allocated their caches and
described them in the engine's folder. :class:`RankConnection` is the
scheduler's :class:`~kvelastic.roles.CacheConnection` to them: the remote
mapper and sharded cache view, the host tier's index with a copier that sends
commands, and the step hook that attaches each step's commands to its
``SchedulerOutput``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

from kvelastic.errors import KvelasticError, PatchError
from kvelastic.pool.backend import DoneFence, Fence
from kvelastic.roles import CacheConnection, Copier
from kvelastic.tp import board as shm
from kvelastic.tp import engine_folder, start_state
from kvelastic.tp.idle_steps import IdleSteps
from kvelastic.tp.rank_hosts import ranks_elsewhere, report_gpus_left_out, split_by_host
from kvelastic.tp.remote_mapper import AUTO, BOARD, STEP, RemoteMapper
from kvelastic.tp.report_merger import step_report_of
from kvelastic.tp.sharded_cache import ShardedKVCache

if TYPE_CHECKING:
    from kvelastic.roles import AccountLink
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.startup.runtime import Runtime
    from kvelastic.offload.host_memory import SlotSupply
    from kvelastic.offload.host_tier import HostTier
    from kvelastic.offload.plan import HostPlan
    from kvelastic.settings import Settings

log = logging.getLogger("vllm.kvelastic")

RANKS_WAIT_S = 30.0


def connect_ranks(scheduler: Any, runtime: "Runtime", lock: ContextManager,
                  wait_s: float | None = None) -> "RankConnection":
    """The ranks' caches, found through the engine's folder; PatchError if they never show up.

    ``lock``: the scheduler's, taken to send commands while the engine idles.
    """
    wait_s = RANKS_WAIT_S if wait_s is None else wait_s
    parallel = scheduler.vllm_config.parallel_config  # fields declared in patches/engine_config.py
    world = int(parallel.world_size)
    if int(parallel.pipeline_parallel_size) > 1 and runtime.settings.pipeline != "allow":
        raise PatchError("kvelastic: pipeline parallelism is refused (KVELASTIC_PIPELINE=refuse). Unset it "
                         "or set KVELASTIC_PIPELINE=allow (each stage maps and confirms its own layers' page "
                         "groups), run with pipeline_parallel_size=1, or set KVELASTIC=0")
    folder = shm.engine_dir(os.getpid())
    handovers = runtime.ray_handovers
    confirm = _confirmations(runtime.settings.tp_confirm, parallel, handovers.handed_over(folder))
    infos = _rank_infos(folder, world, wait_s, handovers.described(folder), handovers.ranks_elsewhere(folder))
    connection = RankConnection(folder, infos, runtime.settings.limit_bytes, lock, confirm=confirm)
    atexit.register(_remove_idle_files, folder)
    log.info("kvelastic: scheduler drives %d worker ranks through %s (mapped groups confirmed %s%s)", world,
             folder, "on the steps' replies" if confirm == STEP else "on the ranks' boards",
             f"; ranks {list(connection.ranks_elsewhere)} on other hosts, reached on vLLM's calls only"
             if connection.ranks_elsewhere else "")
    return connection


def _confirmations(setting: str, parallel: Any, handed_over: bool) -> str:
    """``KVELASTIC_TP_CONFIRM`` for this engine. ``step`` needs a ``MultiprocExecutor``, whose replies
    :mod:`kvelastic.patches.executor_step_report` gathers: vLLM's multiprocess executor, or Ray's V2
    executor, known by the hand-over of the engine's folder (``handed_over``; it refused any other Ray
    executor before the ranks made their KV caches). ``auto`` (the default) is ``step`` there and ``board``
    elsewhere; an explicit ``step`` elsewhere is a PatchError."""
    if setting == BOARD:
        return BOARD
    from kvelastic.tp.ray_executor import RAY

    backend = parallel.distributed_executor_backend
    if backend == "mp" or (backend == RAY and handed_over):
        return STEP
    if setting == AUTO:
        return BOARD
    raise PatchError(f"kvelastic: KVELASTIC_TP_CONFIRM=step needs vLLM's multiprocess executor "
                     f"(distributed_executor_backend='mp') or Ray's V2 executor with KVELASTIC_RAY=allow (its "
                     f"ranks handed this engine's folder), not {backend!r}"
                     f"{' without that hand-over' if backend == RAY else ''}; set KVELASTIC_TP_CONFIRM=auto "
                     "(or board) to confirm through shared memory on this host")


class RankConnection(CacheConnection):
    """The scheduler's side of KV caches sharded over worker ranks: commands out with each step, confirmations
    in (off the ranks' boards, or on the steps' replies).

    Groups mapped on every rank at start-up are adopted; a group mapped on
    only some ranks is unmapped with the first step (read off the boards, or in
    ``STEP`` mode from the ranks' descriptions, opening no board:
    :mod:`kvelastic.tp.start_state`). ``limit_bytes`` (the user's) overrides
    the smallest limit the ranks profiled. Under pipeline
    parallelism the ranks hold different layers, so a group's bytes differ by
    stage: the scheduler counts each group at the largest (the stage that
    reaches its limit first), and a host-tier slot holds every rank's share.
    """

    unmaps_between_steps = False  # the ranks unmap with the step that carries the command

    def __init__(self, folder: Path, infos: Sequence[shm.RankInfo], limit_bytes: int | None = None,
                 lock: ContextManager | None = None, confirm: str = BOARD, here: str | None = None):
        """``confirm``: where the ranks' confirmations come from (:data:`~kvelastic.tp.remote_mapper.BOARD`
        or :data:`~kvelastic.tp.remote_mapper.STEP`). ``here``: this process's host identity (read if None);
        ranks whose descriptions name another host are reached in ``STEP`` mode only, with no file."""
        first = infos[0]
        if any(i.layout.num_groups != first.layout.num_groups or i.layout.blocks_per_group
               != first.layout.blocks_per_group for i in infos):
            raise PatchError("kvelastic: the worker ranks laid out their KV caches differently; "
                             "every rank must hold the same blocks")
        self.here = engine_folder.host_identity() if here is None else here
        self.ranks_elsewhere = ranks_elsewhere(infos, self.here)
        if self.ranks_elsewhere and confirm != STEP:
            raise PatchError(f"kvelastic: worker ranks {list(self.ranks_elsewhere)} run on another host, whose "
                             f"boards this scheduler cannot read; set KVELASTIC_TP_CONFIRM=step")
        # idle delivery through the folder opens the boards when it first needs them (the folder's row 2); with
        # a rank on another host there is none to open: commands queued while idle wait for the next step
        open_boards = None if self.ranks_elsewhere else functools.partial(_open_boards, folder, infos)
        if confirm == STEP:
            start = start_state.of_descriptions(infos)
            mapper = RemoteMapper(folder, [], start, confirm, world=len(infos), open_boards=open_boards)
        else:
            boards = _open_boards(folder, infos)
            start = start_state.of_boards(boards, first.layout.num_groups)
            mapper = RemoteMapper(folder, boards, start, confirm)
        mapper.request_unmap(start.partial)
        limits = [i.limit_bytes for i in infos if i.limit_bytes]
        self.mapper = mapper
        self.infos = tuple(infos)
        largest = max(infos, key=lambda i: i.group_bytes)
        self.cache = ShardedKVCache(mapper, largest, limit_bytes or (min(limits) if limits else None), lock)
        self.rank_held_bytes = mapper.rank_held_bytes
        self.async_loads = mapper.confirm == STEP  # an asynchronous load's completion comes with the ranks' reports
        # in step mode, where vLLM's engine loop can be woken, commands queued while idle ride an empty step
        self.idle_steps = IdleSteps(lambda: mapper.pending_commands) if confirm == STEP else None
        self.cache.pool.idle_steps = self.idle_steps
        self.host_slots = min(i.host_slots for i in infos)  # a slot must exist on every rank
        self.slot_bytes = sum(i.slot_bytes for i in infos)  # one slot of the index: every rank's share of a block

    def host_tier(self, settings: "Settings", plan: "HostPlan") -> tuple["HostTier", Copier]:
        """The host-tier index on the scheduler; the slots' memory is one pinned buffer per rank, and a
        slot is handed out once every rank has pinned it."""
        from kvelastic.offload.host_tier import HostTier
        from kvelastic.offload.write_through import ahead_slots
        from kvelastic.tp.host_supply import RankHostSupply, ReportedHostSupply

        if not self.host_slots:
            raise PatchError("kvelastic: KVELASTIC_CPU_BYTES is set for the scheduler but the worker ranks "
                             "set up no host tier; give every process of the engine the same environment")
        if self.mapper.confirm == STEP:  # the ranks' pinned counts come on the steps' replies
            supply: "SlotSupply" = ReportedHostSupply(self.mapper.world)
            self.mapper.follow_pinning(supply)
        else:
            supply = RankHostSupply(self.mapper.boards)
        tier = HostTier(self.host_slots * self.slot_bytes, self.slot_bytes, pin=False, allocate=False,
                        policy=settings.cpu_policy, supply=supply,
                        ahead_slots=ahead_slots(self.host_slots) if plan.write_through else 0)
        return tier, RemoteCopier(self.mapper, self.slot_bytes)

    def step_hook(self, scheduler: Any, queue: "PageAwareFreeQueue") -> Callable[[Any], None]:
        return functools.partial(end_step, scheduler, queue, self.mapper)

    def reply_hook(self) -> Callable[[Any], None] | None:
        """With confirmations on the steps' replies: adopt the ranks' reports each output brings."""
        return functools.partial(adopt_reply, self.mapper) if self.mapper.confirm == STEP else None

    def idle_work(self) -> IdleSteps | None:
        """In step mode: commands wait for idle ranks, and an engine loop can be woken to send them
        (:mod:`kvelastic.tp.idle_steps`). The scheduler's ``has_requests()`` says so."""
        return self.idle_steps

    def join_account(self, scheduler: Any, runtime: "Runtime") -> "AccountLink | None":
        """Join the shared account of every GPU on this host the ranks are on, for them.

        The ranks create pages only on the scheduler's commands, so the
        scheduler is the member: a map is charged to every GPU's account (at
        the bytes a group takes there) before it is sent, a refusal by any is a
        scheduling miss, and an unmap gives the bytes back. Over several GPUs
        the memberships act as one (:class:`~kvelastic.scheduler.link_group.LinkGroup`). A GPU on another
        host has its account there: it is left out here (logged once), never counted in this host's
        account of a GPU of the same name.
        """
        if not all(info.gpu_id for info in self.infos):
            return None
        local, elsewhere = split_by_host(self.infos, self.here)
        report_gpus_left_out(elsewhere)
        from kvelastic.cluster.ledger import BudgetLedger
        from kvelastic.scheduler.cluster_link import join_shared_account
        from kvelastic.scheduler.link_group import LinkGroup
        from kvelastic.tp.gpu_charge import Charge

        pool, largest = self.cache.pool, self.cache.group_bytes
        charges, links = [], []
        for gpu_id, infos in _by_gpu(local).items():
            group_bytes = sum(i.group_bytes for i in infos)
            charge = Charge(BudgetLedger(), group_bytes, len(infos))
            # what the ranks hold already (counted: no member yet), handed to the account as it joins
            charge.ledger.charge(charge.bytes_for(pool.held_bytes() // largest, pool.reserve_pages * pool.page_bytes))
            link = join_shared_account(self.cache, charge.ledger, scheduler, runtime.settings,
                                       pool.limit_bytes and pool.limit_bytes * group_bytes // largest,
                                       device=(gpu_id, infos[0].gpu_total or None), group_bytes=group_bytes,
                                       install=len(self.infos) == 1)
            charges.append(charge)
            if link is not None:
                links.append(link)
        self.mapper.charge_to(charges)
        if not links:
            return None
        return links[0] if len(self.infos) == 1 else LinkGroup(self.cache, links)


def _by_gpu(infos: Sequence[shm.RankInfo]) -> dict[str, list[shm.RankInfo]]:
    """The ranks on each GPU (one each, unless ranks share a GPU)."""
    found: dict[str, list[shm.RankInfo]] = {}
    for info in infos:
        found.setdefault(info.gpu_id, []).append(info)
    return found


def _open_boards(folder: Path, infos: Sequence[shm.RankInfo]) -> list[shm.RankBoard]:
    """Every rank's board, read-only (FileNotFoundError or SharedFileError where one cannot be opened)."""
    return [shm.RankBoard.of_rank(folder, i.rank, i.layout.num_groups, create=False) for i in infos]


def _remove_idle_files(folder: Path) -> None:
    for _, _, path in shm.idle_files(folder):
        path.unlink(missing_ok=True)
    try:
        folder.rmdir()  # the ranks remove their own files; the last one out removes the folder
    except OSError:
        pass


def _rank_infos(folder: Path, world: int, wait_s: float, sent: Sequence[shm.RankInfo] | None,
                elsewhere: Sequence[int] = ()) -> list[shm.RankInfo]:
    """The ranks' descriptions: those Ray's ranks ``sent`` back over ``collective_rpc`` after the folder's
    hand-over (:class:`~kvelastic.tp.handovers.RayHandovers`), else their files in ``folder``; PatchError at
    once, with no wait, where a rank on another host (pids ``elsewhere``) sent none: it writes no file."""
    if sent is not None and len(sent) == world:
        return list(sent)
    if elsewhere:
        raise PatchError(f"kvelastic: the Ray workers on other hosts (pids {list(elsewhere)}) did not all send "
                         f"their descriptions back, and they write none to {folder}: give every process of the "
                         f"engine KVELASTIC=1 and the same kvelastic, or set KVELASTIC=0 for this engine")
    return _wait_for_ranks(folder, world, wait_s)


def _wait_for_ranks(folder: Path, world: int, wait_s: float) -> list[shm.RankInfo]:
    deadline = time.monotonic() + wait_s
    while True:
        infos = [shm.read_info(folder, r) for r in range(world)]
        if all(infos):
            return infos  # type: ignore[return-value]
        if time.monotonic() > deadline:
            missing = [r for r, i in enumerate(infos) if i is None]
            raise PatchError(
                f"kvelastic: the scheduler found no elastic KV cache in its process and worker ranks "
                f"{missing} of {world} did not describe theirs in {folder}. The executor is not one "
                f"kvelastic supports (the uniprocess or multiprocess executor, or Ray's V2 executor on one "
                f"host with KVELASTIC_RAY=allow), or "
                f"the workers run without KVELASTIC=1; or set KVELASTIC=0 for this engine")
        time.sleep(0.05)


def demand_of(scheduler: Any) -> int:
    """Blocks the requests need soon: what each still has to compute, at least one per running one.

    Waiting requests count in full, so one miss maps for the whole queue at
    once; a running request still in (chunked) prefill counts its remaining
    prompt, a decoding one its next block. Without the running requests'
    share, a chunk would find no mapped block and vLLM would preempt. What is
    read (the queues, the block size, the requests' token counts) is declared
    in ``patches/scheduler_block_pool.py``.
    """
    block = int(scheduler.cache_config.block_size)
    blocks = 0
    for request in scheduler.running:  # one loop, no call per request: it runs every step over all of them
        left = request.num_tokens - request.num_computed_tokens
        blocks += -(-left // block) if left > block else 1
    for request in scheduler.waiting:
        left = request.num_tokens - request.num_computed_tokens
        if left > 0:
            blocks += -(-left // block)
    return blocks


def end_step(scheduler: Any, queue: "PageAwareFreeQueue", mapper: RemoteMapper, output: Any) -> None:
    """After ``schedule()``: ask for what the requests need soon, then give the step's output every
    command queued so far, as ``kvelastic_plan`` (vLLM broadcasts it to every rank)."""
    queue.want_blocks(demand_of(scheduler))
    output.kvelastic_plan = mapper.take_plan()


def adopt_reply(mapper: RemoteMapper, model_runner_output: Any) -> None:
    """Before ``update_from_output``: the ranks' reports on this step's output, if it carries any."""
    report = step_report_of(model_runner_output)
    if report is not None:
        mapper.adopt(report)


class RemoteCopier(Copier):
    """The :class:`~kvelastic.roles.Copier` role as commands every rank runs on its own shard."""

    def __init__(self, mapper: RemoteMapper, bytes_per_block: int):
        self.mapper = mapper
        self.bytes_per_block = bytes_per_block

    def store(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = False) -> Fence:
        """Each rank orders the copy before any later unmap of those blocks; with ``block_compute``
        before the step's compute too. Otherwise the scheduler never learns when it is done."""
        if not block_ids:
            return DoneFence()
        self.mapper.request_store(block_ids, slots, block_compute)
        return DoneFence() if block_compute else RankCopyFence()

    def load(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = True) -> Fence:
        """Before the step's compute on every rank; or (``block_compute=False``, with the ranks' reports)
        beside it, done once every rank reported it on a step's reply."""
        if not block_ids:
            return DoneFence()
        seq = self.mapper.request_load(block_ids, slots, block_compute)
        return DoneFence() if block_compute else RankLoadFence(self.mapper, seq)

    def fence_compute(self) -> None:
        self.mapper.request_wait()

    def copy_times(self) -> None:
        """The copies run on the ranks; their GPU time is not brought back."""
        return None


class RankLoadFence(Fence):
    """An asynchronous load on every rank: done once each rank's report said so (``STEP`` mode).

    Waiting for it here cannot work: the reports come with later steps, which
    the engine runs only after this thread moves on. Nothing needs to: its blocks
    stay held until it is done, and a rank runs any later copy into its host
    slots after it on the same copy stream.
    """

    def __init__(self, mapper: RemoteMapper, seq: int):
        self.mapper = mapper
        self.seq = seq
        self._done = False

    def is_done(self) -> bool:
        self._done = self._done or self.mapper.load_done(self.seq)
        return self._done

    def wait(self) -> None:
        if not self.is_done():
            raise KvelasticError("internal: an asynchronous load on the worker ranks is learnt done only from a "
                                 "later step's replies; the scheduler cannot wait for it")


class RankCopyFence(Fence):
    """A copy running on the ranks beside their compute: the scheduler cannot see it finish.

    Never done from here, so a block it reads and is reused always gets a WAIT
    (cheap on a rank where the copy is long done). Waiting for it here would
    block the scheduler on other processes; the ranks order it instead.
    """

    def is_done(self) -> bool:
        return False

    def wait(self) -> None:
        raise KvelasticError("internal: a rank's copy cannot be waited for from the scheduler; "
                             "the rank orders it before its unmaps and (after a WAIT) its compute")
