"""The worker-rank side: apply the scheduler's commands to this rank's pool, report back.

Commands arrive with each step (``RankWorker.before_step``, called before the
forward pass) or, while the engine is idle, as files in the engine's folder
(picked up by a daemon thread). Both paths apply commands in number order
under one lock, each at most once. The exception: a step's MAPs wait until its
forward pass is launched (``after_step``), when the GPU computes and the CPU is
free, unless a later command of the plan touches their groups
(:func:`~kvelastic.tp.protocol.maps_after_launch` says why that is exact). A rank
never waits for another rank or for the scheduler: a map it cannot make is
reported as refused on its board and the scheduler turns that into a
scheduling miss.

A rank on another host than its engine core (Ray, ``KVELASTIC_TP_CONFIRM=step``)
has no engine folder (``folder`` None): its board stays in its own memory
(:class:`~kvelastic.tp.rank_board.InProcessBoard`), it writes no file, and its
commands come only with the steps, empty ones included.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from kvelastic.errors import KvelasticError
from kvelastic.scheduler.elastic_cache import NULL_GROUP, ElasticKVCache
from kvelastic.pool.backend import Fence
from kvelastic.pool.reserve_growth import grow_in_chunks
from kvelastic.shared.errors import SharedFileError
from kvelastic.tp import board as shm
from kvelastic.tp import host_supply
from kvelastic.tp.folder_watch import FolderWatch
from kvelastic.tp.rank_board import rank_board
from kvelastic.tp.protocol import (LOAD, MAP, RESERVE, START_SEQ, STORE, UNMAP, WAIT, Command, StepPlan,
                                   maps_after_launch)
from kvelastic.tp.step_report import RankReport

if TYPE_CHECKING:
    from kvelastic.offload.copier import BlockCopier

log = logging.getLogger("vllm.kvelastic")

IDLE_POLL_S = 0.02
DEVICE_FREE_PERIOD_S = 0.05


class RankWorker:
    """Applies page-group and copy commands on one rank's elastic KV cache."""

    def __init__(self, cache: ElasticKVCache, folder: Path | None, info: shm.RankInfo,
                 copier: "BlockCopier | None" = None, map_after_launch: bool = True):
        """``folder``: the engine's folder, None for a rank on another host (it then writes no file).
        ``copier``: this rank's share of the host tier (None without one; then no store or load comes).
        ``map_after_launch``: a step's MAPs wait for its forward pass's launch (``KVELASTIC_TP_MAP_AFTER_LAUNCH``)."""
        self.cache = cache
        self.map_after_launch = map_after_launch
        self.folder = folder
        self.copier = copier
        self.board = rank_board(folder, info.rank, cache.num_groups)
        self.board.set(shm.PID, os.getpid())
        start_groups = sorted(cache.pool.mapped_groups())
        for g in start_groups:
            self.board.groups[g] = START_SEQ
        # the board's start, in the description too: a scheduler confirming on the steps' replies reads no board
        self.info = dataclasses.replace(info, start_groups=tuple(start_groups), applied=self.applied)
        self._pinned = (0, False)  # (host slots pinned, settled), as the pin threads last said
        self._copies: list[Fence] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_free = 0.0
        self.reserve_pages = 0  # unmapped pages kept warm; the scheduler's reclaimer sets it
        self._unreadable: set[Path] = set()  # idle command files reported as unreadable (once each)
        self._unreported: list[tuple[int, int]] = []  # (seq, groups mapped) of MAPs not yet in a report
        self._loads: list[tuple[int, Fence]] = []  # asynchronous LOADs (seq, copy) not yet reported done
        self._first_step: list[Callable[[], None]] | None = []  # run once, at the first step (None after)
        self._handled = self.applied  # the last command run or left for after the launch (the board: run)
        self._deferred: list[Command] = []  # this step's MAPs, left for after its forward pass's launch
        self.maps_kept_in_order = 0  # MAPs a later command of their plan touched: run before the forward
        # the idle thread lists the folder only when it may have changed; with no folder, never
        self._watch = FolderWatch(folder) if folder is not None else None
        self._fitted: int | None = None  # the last command handled when the idle thread last fitted the reserve
        self._reserve_short = True  # that fit left the reserve below its target: try again next tick
        self._report_memory(force=True)
        if folder is not None:
            shm.write_info(folder, self.info)

    # ----------------------------------------------------------------- steps
    def at_first_step(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the first step arrives: vLLM's start-up (CUDA graph capture) is over."""
        if self._first_step is None:
            callback()
        else:
            self._first_step.append(callback)

    def before_step(self, plan: StepPlan) -> None:
        """Apply what the step carries (after any idle commands it depends on), before the forward; the MAPs
        that may wait are left for :meth:`after_step`."""
        if self._first_step is not None:
            callbacks, self._first_step = self._first_step, None
            for callback in callbacks:
                callback()
        if not plan.commands and not self._deferred and plan.idle_upto <= self._handled:
            return  # most decode steps: nothing to run. Only this thread defers maps, and the idle
            # thread advances _handled past a command only once it ran, so no lock is needed to know
        with self._lock:
            if self._deferred:  # the last step's forward failed before its maps ran: they still come first
                self._apply_deferred()
            if plan.idle_upto > self._handled:
                self._apply_idle_files()
            self._apply(plan.commands, later=self._maps_to_defer(plan.commands))

    def after_step(self, plan: StepPlan) -> None:
        """The step's forward pass is launched: apply the MAPs left for now (the GPU computes meanwhile, and
        none of its blocks is in their groups), then mark the step run (a later unmap is fenced behind it).
        Confirmations (board, report) follow the maps, so no group is confirmed before it is mapped."""
        if self._deferred:  # only this thread adds to it: seen empty, it is empty
            with self._lock:
                if self._deferred:
                    self._apply_deferred()
        self.board.set(shm.STEPS_DONE, plan.step)

    def take_report(self) -> RankReport:
        """What this rank did since its last report, for the step's reply (each MAP reported once)."""
        with self._lock:
            maps, self._unreported = tuple(self._unreported), []
            loads = tuple(seq for seq, copy in self._loads if copy.is_done())
            self._loads = [(seq, copy) for seq, copy in self._loads if seq not in loads]
            free = self.cache.pool.backend.device_free_bytes()
            stats = self.cache.pool.stats()
            ready, settled = self._pinned
            return RankReport(rank=self.info.rank, applied=self.applied, step=self.board.get(shm.STEPS_DONE),
                              maps=maps, loads=loads, device_free=-1 if free is None else free,
                              held_bytes=stats.held_bytes, mapped_bytes=stats.mapped_bytes,
                              host_ready=ready, host_settled=settled)

    def pinned(self, ready_slots: int, settled: bool) -> None:
        """The host-tier share's pin threads: ``ready_slots`` are pinned (``settled``: all there will be).
        Published on the board (``board`` mode reads it there) and kept for the next report (``step``
        mode), each as one store, so no reader sees a count without its "settled"."""
        host_supply.publish(self.board, ready_slots, settled)
        self._pinned = (ready_slots, settled)

    @property
    def applied(self) -> int:
        return self.board.get(shm.APPLIED)

    # ------------------------------------------------------------- idle path
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvelastic-rank{self.info.rank}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self.folder is not None:
            shm.remove_rank_files(self.folder, self.info.rank)

    def _run(self) -> None:
        if self.copier is not None:
            _use_device_of(self.copier)
        while not self._stop.wait(IDLE_POLL_S):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the rank must keep serving steps
                if self._watch is not None:
                    self._watch.forget()  # the next tick does all of it again
                self._fitted = None
                log.exception("kvelastic: rank %d failed to apply idle commands", self.info.rank)

    def _tick(self) -> None:
        """One idle tick. It shares the GIL with the worker's thread, which launches the steps, so it does
        only what may have become due: the folder's listing when the folder changed (:class:`FolderWatch`),
        the reserve's fit when commands ran, fenced unmaps finished or the last fit fell short (the pool
        changes only then); ``pool.collect`` and the throttled memory report as ever."""
        with self._lock:
            if self._deferred or (self._watch is not None and self._watch.should_look()):
                self._apply_idle_files()
        finished = self.cache.pool.collect()
        handled = self._handled
        if finished or self._reserve_short or handled != self._fitted:
            self._fitted = handled
            self._reserve_short = self._fit_reserve(grow=True)
        self._report_memory()

    def _apply_idle_files(self) -> None:
        if self._deferred:  # idle commands come after the step's MAPs: the maps go first, as numbered
            self._apply_deferred()
        if self.folder is None:
            return  # no folder, no idle files: the scheduler sends such a rank commands only with steps
        applied = self._handled
        for _, last, path in shm.idle_files(self.folder):
            if last > applied:
                try:
                    commands = shm.read_idle_commands(path)
                except FileNotFoundError:
                    continue  # the scheduler removed it: every rank had applied it
                except SharedFileError as error:  # never a crashed rank: its groups stay unconfirmed
                    if path not in self._unreadable:
                        self._unreadable.add(path)
                        log.error("kvelastic: rank %d cannot read idle commands: %s", self.info.rank, error)
                    return
                self._apply(commands)
                applied = self._handled

    # -------------------------------------------------------------- commands
    def _maps_to_defer(self, commands: Sequence[Command]) -> frozenset[int]:
        """The plan's MAPs to apply after the forward pass's launch (none with ``map_after_launch`` off)."""
        if not self.map_after_launch:
            return frozenset()
        later = maps_after_launch(commands, self.cache.group_of_block)
        kept = sum(1 for c in commands if c[1] == MAP and c[0] > self._handled and c[0] not in later)
        if kept:
            self.maps_kept_in_order += kept
            log.debug("kvelastic: rank %d maps %d groups' commands before the forward: a later command of "
                      "the plan touches them", self.info.rank, kept)
        return later

    def _apply(self, commands: Sequence[Command], later: frozenset[int] = frozenset()) -> None:
        """Run the commands not handled yet, in order, but leave those in ``later`` (MAPs) for
        :meth:`_apply_deferred`: the board's applied mark stops before the first of them, so it never
        claims a map not made. With no new command, nothing else happens either."""
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
                    self.board.set(shm.APPLIED, seq)
            self._handled = seq
        if self._handled != start and not self._deferred:
            self._settle()  # most decode steps: no pool statistics or driver calls before the forward

    def _apply_deferred(self) -> None:
        """The MAPs left for after the launch, in order; then the applied mark covers every command handled."""
        deferred, self._deferred = self._deferred, []
        for command in deferred:
            self._map(command[0], command[2])
        self.board.set(shm.APPLIED, self._handled)
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
        """After commands ran: forget finished copies, trim the warm reserve, publish memory."""
        self._copies = [f for f in self._copies if not f.is_done()]
        self._fit_reserve(grow=False)
        self._report_memory(force=True)

    def _map(self, seq: int, groups: Sequence[int]) -> None:
        """Map what this rank can; the board shows ``seq`` for each group mapped, ``-seq`` for each refused."""
        done = self.cache.map_as_many(groups)
        self._unreported.append((seq, done))
        for g in groups[:done]:
            self.board.groups[g] = seq
        for g in groups[done:]:
            self.board.groups[g] = -seq

    def _unmap(self, groups: Sequence[int]) -> None:
        groups = [g for g in groups if g != NULL_GROUP]
        for g in groups:
            self.board.groups[g] = 0
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

    def _report_memory(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_free < DEVICE_FREE_PERIOD_S:
            return
        self._last_free = now
        free = self.cache.pool.backend.device_free_bytes()
        stats = self.cache.pool.stats()
        self.board.set(shm.DEVICE_FREE, -1 if free is None else free)
        self.board.set(shm.MAPPED_BYTES, stats.mapped_bytes)
        self.board.set(shm.HELD_BYTES, stats.held_bytes)


def _use_device_of(copier: "BlockCopier") -> None:
    """Make this thread's current CUDA device the copier's (copies issued here allocate on it)."""
    if copier.cuda:
        import torch

        torch.cuda.set_device(copier.device)
