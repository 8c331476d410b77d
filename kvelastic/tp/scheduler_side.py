"""Connect an engine's scheduler to worker ranks running in other processes.

Called by ``attach_scheduler`` when its process holds no KV cache: the ranks
have already made their caches, and the executor brought back their
descriptions over vLLM's ``collective_rpc``
(:mod:`kvelastic.tp.executor_handover`). :class:`RankConnection` is the
scheduler's :class:`~kvelastic.hooks.connection.CacheConnection` to them: the remote
mapper and sharded cache view, the host tier's index with a copier that sends
commands, the step hook that attaches each step's commands to its
``SchedulerOutput``, and the reply hook that adopts the ranks' reports.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

from kvelastic.errors import KvelasticError, PatchError
from kvelastic.pool.backend import DoneFence, Fence
from kvelastic.hooks.connection import CacheConnection, member_terms
from kvelastic.roles import Copier
from kvelastic.tp import rank_handover, start_state
from kvelastic.tp.idle_steps import IdleSteps
from kvelastic.tp.rank_hosts import ranks_elsewhere, report_gpus_left_out, split_by_host
from kvelastic.tp.rank_info import RankInfo
from kvelastic.tp.remote_mapper import RemoteMapper
from kvelastic.patches.worker_execute_model import PLAN
from kvelastic.tp.report_merger import step_report_of
from kvelastic.tp.sharded_cache import ShardedKVCache

if TYPE_CHECKING:
    from kvelastic.roles import AccountLink
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.startup.runtime import Runtime
    from kvelastic.offload.host_tier import HostTier
    from kvelastic.offload.plan import HostPlan
    from kvelastic.settings import Settings
    from kvelastic.tp.handovers import RankHandovers

log = logging.getLogger("vllm.kvelastic")


def connect_ranks(scheduler: Any, runtime: "Runtime", lock: ContextManager) -> "RankConnection":
    """The ranks' caches, as their descriptions say; PatchError where the executor brought none back.

    ``lock``: the scheduler's, taken to send commands while the engine idles.
    """
    parallel = scheduler.vllm_config.parallel_config  # fields declared in patches/engine_config.py
    world = int(parallel.world_size)
    infos = _descriptions(runtime.rank_handovers, world, parallel.distributed_executor_backend)
    connection = RankConnection(infos, runtime.settings.limit_bytes, lock)
    log.info("kvelastic: scheduler drives %d worker ranks over vLLM's calls (commands on the steps, confirmations "
             "on their replies)%s", world,
             f"; ranks {list(connection.ranks_elsewhere)} on other hosts" if connection.ranks_elsewhere else "")
    return connection


def _descriptions(handovers: "RankHandovers", world: int, backend: Any) -> list[RankInfo]:
    """Every rank's description, as the executor brought them back; PatchError naming what is missing."""
    if not handovers.was_asked:
        raise PatchError(
            f"kvelastic: the scheduler found no elastic KV cache in its process, and its executor "
            f"({backend!r}) asked no worker rank for one: kvelastic reaches worker ranks only through vLLM's "
            f"multiprocess executor (--distributed-executor-backend mp) and Ray's V2 executor, and keeps the "
            f"cache in this process under the uniprocess executor; use one of those, or set KVELASTIC=0 for "
            f"this engine")
    infos = handovers.described()
    if infos is None or len(infos) != world:
        raise PatchError(
            f"kvelastic: the scheduler found no elastic KV cache in its process and the {world} worker ranks did "
            f"not all describe theirs: the workers run without kvelastic (give every process of the engine "
            f"KVELASTIC=1 and the same kvelastic), or set KVELASTIC=0 for this engine")
    return list(infos)


class RankConnection(CacheConnection):
    """The scheduler's side of KV caches sharded over worker ranks: commands out with each step, the ranks'
    reports in on the steps' replies.

    Groups mapped on every rank at start-up are adopted; a group mapped on
    only some ranks is unmapped with the first step (from the ranks'
    descriptions: :mod:`kvelastic.tp.start_state`). ``limit_bytes`` (the
    user's) overrides the smallest limit the ranks profiled. Under pipeline
    parallelism the ranks hold different layers, so a group's bytes differ by
    stage: the scheduler counts each group at the largest (the stage that
    reaches its limit first), and a host-tier slot holds every rank's share.
    """

    unmaps_between_steps = False  # the ranks unmap with the step that carries the command
    async_loads = True  # an asynchronous load's completion comes with the ranks' reports

    def __init__(self, infos: Sequence[RankInfo], limit_bytes: int | None = None,
                 lock: ContextManager | None = None, here: str | None = None):
        """``here``: this process's host identity (read if None); ranks whose descriptions name another host
        share no GPU account on this one."""
        first = infos[0]
        if any(i.layout.num_groups != first.layout.num_groups or i.layout.blocks_per_group
               != first.layout.blocks_per_group for i in infos):
            raise PatchError("kvelastic: the worker ranks laid out their KV caches differently; "
                             "every rank must hold the same blocks")
        self.here = rank_handover.host_identity() if here is None else here
        self.ranks_elsewhere = ranks_elsewhere(infos, self.here)
        start = start_state.of_descriptions(infos)
        mapper = RemoteMapper(len(infos), start)
        mapper.request_unmap(start.partial)
        limits = [i.limit_bytes for i in infos if i.limit_bytes]
        self.mapper = mapper
        self.infos = tuple(infos)
        largest = max(infos, key=lambda i: i.group_bytes)
        self.cache = ShardedKVCache(mapper, largest, limit_bytes or (min(limits) if limits else None), lock)
        self.rank_held_bytes = mapper.rank_held_bytes
        # commands queued while the engine idles ride a step of no tokens, where vLLM's engine loop can be woken
        self.idle_steps = IdleSteps(lambda: mapper.pending_commands, stepped=lambda: mapper.steps > 0)
        self.cache.pool.idle_steps = self.idle_steps
        self.host_slots = min(i.host_slots for i in infos)  # a slot must exist on every rank
        self.slot_bytes = sum(i.slot_bytes for i in infos)  # one slot of the index: every rank's share of a block

    def host_tier(self, settings: "Settings", plan: "HostPlan") -> tuple["HostTier", Copier]:
        """The host-tier index on the scheduler; the slots' memory is one pinned buffer per rank, and a
        slot is handed out once every rank reported it pinned."""
        from kvelastic.offload.host_tier import HostTier
        from kvelastic.offload.write_through import ahead_slots
        from kvelastic.tp.host_supply import ReportedHostSupply

        if not self.host_slots:
            raise PatchError("kvelastic: KVELASTIC_CPU_BYTES is set for the scheduler but the worker ranks "
                             "set up no host tier; give every process of the engine the same environment")
        supply = ReportedHostSupply(self.mapper.world)  # the ranks' pinned counts come on the steps' replies
        self.mapper.follow_pinning(supply)
        tier = HostTier(self.host_slots * self.slot_bytes, self.slot_bytes, pin=False, allocate=False,
                        policy=settings.cpu_policy, supply=supply,
                        ahead_slots=ahead_slots(self.host_slots) if plan.write_through else 0)
        return tier, RemoteCopier(self.mapper, self.slot_bytes)

    def step_hook(self, scheduler: Any, queue: "PageAwareFreeQueue") -> Callable[[Any], None]:
        return functools.partial(end_step, scheduler, queue, self.mapper)

    def reply_hook(self) -> Callable[[Any], None]:
        """Adopt the ranks' reports each step's output brings."""
        return functools.partial(adopt_reply, self.mapper)

    def idle_work(self) -> IdleSteps:
        """Commands wait for idle ranks, and an engine loop can be woken to send them
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
            link = join_shared_account(self.cache, charge.ledger, member_terms(runtime.settings, scheduler),
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


def _by_gpu(infos: Sequence[RankInfo]) -> dict[str, list[RankInfo]]:
    """The ranks on each GPU (one each, unless ranks share a GPU)."""
    found: dict[str, list[RankInfo]] = {}
    for info in infos:
        found.setdefault(info.gpu_id, []).append(info)
    return found


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
    PLAN.put(output, mapper.take_plan())


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
    """An asynchronous load on every rank: done once each rank's report said so.

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
