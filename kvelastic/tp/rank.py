"""The worker-rank side: apply the scheduler's commands to this rank's pool, report back on the steps' replies.

Commands arrive only with the steps (``RankWorker.before_step``, called before
the forward pass), empty steps included, and run in number order, each at most
once. The exception: a step's MAPs wait until its forward pass is launched
(``after_step``), when the GPU computes and the CPU is free, unless a later
command of the plan touches their groups
(:func:`~kvelastic.tp.protocol.maps_after_launch` says why that is exact). A rank
never waits for another rank or for the scheduler: a map it cannot make is
reported as refused (:meth:`take_report`) and the scheduler turns that into a
scheduling miss. The rank opens no file: everything it says rides vLLM's calls.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from kvelastic.errors import KvelasticError
from kvelastic.scheduler.elastic_cache import NULL_GROUP, ElasticKVCache
from kvelastic.pool.backend import Fence
from kvelastic.pool.reserve_growth import grow_in_chunks
from kvelastic.tp.protocol import LOAD, MAP, RESERVE, STORE, UNMAP, WAIT, Command, StepPlan, maps_after_launch
from kvelastic.tp.rank_info import RankInfo
from kvelastic.tp.step_report import RankReport

if TYPE_CHECKING:
    from kvelastic.offload.copier import BlockCopier

log = logging.getLogger("vllm.kvelastic")

IDLE_POLL_S = 0.02


class RankWorker:
    """Applies page-group and copy commands on one rank's elastic KV cache."""

    def __init__(self, cache: ElasticKVCache, info: RankInfo, copier: "BlockCopier | None" = None):
        """``copier``: this rank's share of the host tier (None without one; then no store or load comes)."""
        self.cache = cache
        self.copier = copier
        self.applied = 0  # every command up to this one has run (a map left for after the launch holds it back)
        self.steps_done = 0  # the last step whose commands, maps included, all ran
        # the groups vLLM's start-up mapped, and the mark: the scheduler starts from these (start_state.py)
        self.info = dataclasses.replace(info, start_groups=tuple(sorted(cache.pool.mapped_groups())),
                                        applied=self.applied)
        self._pinned = (0, False)  # (host slots pinned, settled), as the pin threads last said: one store
        self._copies: list[Fence] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reserve_pages = 0  # unmapped pages kept warm; the scheduler's reclaimer sets it
        self._unreported: list[tuple[int, int]] = []  # (seq, groups mapped) of MAPs not yet in a report
        self._loads: list[tuple[int, Fence]] = []  # asynchronous LOADs (seq, copy) not yet reported done
        self._first_step: list[Callable[[], None]] | None = []  # run once, at the first step (None after)
        self._handled = self.applied  # the last command run or left for after the launch
        self._deferred: list[Command] = []  # this step's MAPs, left for after its forward pass's launch
        self.maps_kept_in_order = 0  # MAPs a later command of their plan touched: run before the forward
        self._fitted: int | None = None  # the last command handled when the idle thread last fitted the reserve
        self._reserve_short = True  # that fit left the reserve below its target: try again next tick

    # ----------------------------------------------------------------- steps
    def describe(self) -> RankInfo:
        """This rank's description as the engine core asks for it: the groups mapped now and the mark.

        Asked once vLLM's start-up is over (the executor's ``initialize_from_config``,
        warm-up and CUDA graph capture included) and before any command: the groups
        a warm-up mapped after the KV cache was published (vLLM 0.34's kernel
        warm-up, ``patches/warmup_blocks.py``) are in it, so the scheduler adopts and
        later releases them like any other."""
        return dataclasses.replace(self.info, start_groups=tuple(sorted(self.cache.pool.mapped_groups())),
                                   applied=self.applied)

    def at_first_step(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the first step arrives: vLLM's start-up (CUDA graph capture) is over."""
        if self._first_step is None:
            callback()
        else:
            self._first_step.append(callback)

    def before_step(self, plan: StepPlan) -> None:
        """Apply what the step carries before the forward; the MAPs that may wait are left for :meth:`after_step`.
        Only the worker's step thread calls this, :meth:`after_step` and :meth:`take_report`."""
        if self._first_step is not None:
            callbacks, self._first_step = self._first_step, None
            for callback in callbacks:
                callback()
        if self._deferred:  # the last step's forward failed before its maps ran: they still come first
            self._apply_deferred()
        if plan.commands:  # most decode steps carry none
            self._apply(plan.commands, later=self._maps_to_defer(plan.commands))

    def after_step(self, plan: StepPlan) -> None:
        """The step's forward pass is launched: apply the MAPs left for now (the GPU computes meanwhile, and
        none of its blocks is in their groups), then mark the step run. The report follows the maps, so no
        group is confirmed before it is mapped."""
        if self._deferred:
            self._apply_deferred()
        self.steps_done = plan.step

    def take_report(self) -> RankReport:
        """What this rank did since its last report, for the step's reply (each MAP reported once)."""
        maps, self._unreported = tuple(self._unreported), []
        loads = tuple(seq for seq, copy in self._loads if copy.is_done())
        self._loads = [(seq, copy) for seq, copy in self._loads if seq not in loads]
        free = self.cache.pool.backend.device_free_bytes()
        stats = self.cache.pool.stats()
        ready, settled = self._pinned
        return RankReport(rank=self.info.rank, applied=self.applied, step=self.steps_done, maps=maps, loads=loads,
                          device_free=-1 if free is None else free, held_bytes=stats.held_bytes,
                          mapped_bytes=stats.mapped_bytes, host_ready=ready, host_settled=settled)

    def pinned(self, ready_slots: int, settled: bool) -> None:
        """The host-tier share's pin threads: ``ready_slots`` are pinned (``settled``: all there will be), for
        the next report; one store, so no report carries a count without its "settled"."""
        self._pinned = (ready_slots, settled)

    # ------------------------------------------------------------- idle path
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvelastic-rank{self.info.rank}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        if self.copier is not None:
            _use_device_of(self.copier)
        while not self._stop.wait(IDLE_POLL_S):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the rank must keep serving steps
                self._fitted = None
                log.exception("kvelastic: rank %d failed to tend its pool between steps", self.info.rank)

    def _tick(self) -> None:
        """One idle tick. It shares the GIL with the worker's thread, which launches the steps, so it does only
        what may have become due: the fenced unmaps that finished (``pool.collect``), and the warm reserve's fit
        when commands ran, unmaps finished or the last fit fell short (the pool changes only then)."""
        finished = self.cache.pool.collect()
        handled = self._handled
        if finished or self._reserve_short or handled != self._fitted:
            self._fitted = handled
            self._reserve_short = self._fit_reserve(grow=True)

    # -------------------------------------------------------------- commands
    def _maps_to_defer(self, commands: Sequence[Command]) -> frozenset[int]:
        """The plan's MAPs to apply after the forward pass's launch."""
        later = maps_after_launch(commands, self.cache.group_of_block)
        kept = sum(1 for c in commands if c[1] == MAP and c[0] > self._handled and c[0] not in later)
        if kept:
            self.maps_kept_in_order += kept
            log.debug("kvelastic: rank %d maps %d groups' commands before the forward: a later command of "
                      "the plan touches them", self.info.rank, kept)
        return later

    def _apply(self, commands: Sequence[Command], later: frozenset[int] = frozenset()) -> None:
        """Run the commands not handled yet, in order, but leave those in ``later`` (MAPs) for
        :meth:`_apply_deferred`: the applied mark stops before the first of them, so it never claims a map
        not made. With no new command, nothing else happens either."""
        start = self._handled
        for command in commands:
            seq = command[0]
            if seq <= self._handled:
                continue
            if seq in later:
                self._deferred.append(command)
            else:
                self._run_command(command)
                if not self._deferred:
                    self.applied = seq
            self._handled = seq
        if self._handled != start and not self._deferred:
            self._settle()  # most decode steps: no pool statistics or driver calls before the forward

    def _apply_deferred(self) -> None:
        """The MAPs left for after the launch, in order; then the applied mark covers every command handled."""
        deferred, self._deferred = self._deferred, []
        for command in deferred:
            self._map(command[0], command[2])
        self.applied = self._handled
        self._settle()

    def _run_command(self, command: Command) -> None:
        seq, kind = command[0], command[1]
        if kind == MAP:
            self._map(seq, command[2])
        elif kind == UNMAP:
            self._unmap(command[2])
        elif kind == STORE:
            self._copies.append(self._copier().store(command[2], command[3], block_compute=command[4]))
        elif kind == LOAD:
            copy = self._copier().load(command[2], command[3], block_compute=command[4])
            if not command[4]:
                self._loads.append((seq, copy))
        elif kind == WAIT:
            self._copier().fence_compute()
        elif kind == RESERVE:
            self.reserve_pages = command[2]
        else:
            raise ValueError(f"unknown kvelastic command {kind!r}")

    def _settle(self) -> None:
        """After commands ran: forget finished copies, trim the warm reserve."""
        self._copies = [f for f in self._copies if not f.is_done()]
        self._fit_reserve(grow=False)

    def _map(self, seq: int, groups: Sequence[int]) -> None:
        """Map what this rank can (a prefix of ``groups``); the next report says how many."""
        self._unreported.append((seq, self.cache.map_as_many(groups)))

    def _unmap(self, groups: Sequence[int]) -> None:
        groups = [g for g in groups if g != NULL_GROUP]
        self.cache.unmap_groups(groups, after=list(self._copies))

    def _copier(self) -> "BlockCopier":
        if self.copier is None:
            raise KvelasticError(f"rank {self.info.rank} was sent a host-tier copy but has no host tier; "
                                 "give every process of the engine the same KVELASTIC_CPU_BYTES")
        return self.copier

    def _fit_reserve(self, *, grow: bool) -> bool:
        """Give back warm pages beyond the target; create missing ones only off the step path.
        True if growing fell short of the target (the device or the limit had no room yet)."""
        pool = self.cache.pool
        have = pool.stats().reserve_bytes // pool.page_bytes
        if have > self.reserve_pages:
            pool.trim_reserve(self.reserve_pages)
        elif grow:
            missing = max(0, self.reserve_pages - have)
            return grow_in_chunks(pool, missing) < missing  # which also parks recycled pages
        return False


def _use_device_of(copier: "BlockCopier") -> None:
    """Make this thread's current CUDA device the copier's (copies issued here allocate on it)."""
    if copier.cuda:
        import torch

        torch.cuda.set_device(copier.device)
