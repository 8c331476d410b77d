"""The scheduler side's :class:`~kvelastic.roles.Mapper` when the ranks hold the cache: commands to every rank.

The page-aware queue asks for groups to be mapped ahead of need and unmapped
once free, exactly as on one GPU. Here each request becomes a numbered command
in an outbox that the next step's ``SchedulerOutput`` carries to every rank
(:meth:`take_plan`), an empty step's too where the engine idles
(:mod:`kvelastic.tp.idle_steps`). Every rank attaches a report to its reply to
a step that asks for one, and vLLM's executor gathers them
(:mod:`kvelastic.tp.report_merger`); the scheduler's ``update_from_output``
hands them to :meth:`adopt`. A group is reported ``mapped`` only once every
rank reported its command, at the least count any rank mapped; what a rank
refused is reported ``refused`` and unmapped everywhere. Nothing here ever
waits for a rank: an unconfirmed group is simply not handed out yet (a
scheduling miss). How far each rank has pinned its host-tier share comes in the
reports too (:class:`~kvelastic.tp.host_supply.ReportedHostSupply`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable, Sequence

from kvelastic.pool.backend import Fence
from kvelastic.roles import Mapper
from kvelastic.tp.gpu_charge import Charge, charge_all, release_all
from kvelastic.tp.host_supply import ReportedHostSupply
from kvelastic.tp.protocol import (MAP, Command, StepPlan, load_command, map_command, reserve_command,
                                   store_command, unmap_command, wait_command)
from kvelastic.tp.start_state import StartState
from kvelastic.tp.step_report import CommandTally, StepReport, held_by_rank, split_map

log = logging.getLogger("vllm.kvelastic")

REFUSAL_BACKOFF_S = 0.5  # after a rank refused a group, ask for no new group for this long
MAX_REPORTS_WAITED = 8  # a MAP not decided by every rank after this many step reports is refused
PIN_REPORT_PERIOD_S = 0.1  # while a rank still pins its host-tier share, a report step at most this often


class RemoteMapper(Mapper):
    """Queues map/unmap/copy commands for all ranks and adopts groups every rank confirmed."""

    synchronous = False  # the queue must never wait for a map: it cannot be confirmed in the call

    def __init__(self, world: int, start: StartState = StartState()):
        """``world``: the ranks that must each confirm a group; ``start``: the groups to adopt and the command
        number to go on from."""
        self.world = world
        self._tally = CommandTally(world)
        self._sent: dict[int, tuple[tuple[int, ...], int]] = {}  # MAP seq -> (groups, reports seen when sent)
        self._reports_seen = 0
        self._loads_out: set[int] = set()  # asynchronous LOADs not yet reported done by every rank
        self._load_tally = CommandTally(world, entries=lambda report: ((seq, 1) for seq in report.loads))
        self._loads_done: set[int] = set()  # reported by every rank, not yet seen by their fence
        self._rank_free: dict[int, int] = {}
        self._rank_held: dict[int, int] = {}
        self.mapped: deque[int] = deque()  # the Mapper role's: groups every rank confirmed, for the queue
        self.refused: deque[int] = deque()
        self._outbox: list[Command] = []
        self._pending: dict[int, int] = {}  # group -> seq of the map command awaiting confirmation
        self.mapped_groups: set[int] = set(start.adopted)
        self._seq = start.applied
        self._pinning: ReportedHostSupply | None = None  # with a host tier: the ranks' pinned slots
        self._pin_report_at = 0.0  # when a report step is next due for them, while some rank still pins
        self.steps = 0  # plans taken: steps sent to the ranks
        self.backoff_until = 0.0
        self._charges: list[Charge] = []  # the GPUs' shared accounts, once the engine joined them

    def follow_pinning(self, supply: ReportedHostSupply) -> None:
        """Feed ``supply`` each report's pinned host slots, and ask for a report step every
        :data:`PIN_REPORT_PERIOD_S` while some rank still pins: the supply grows from reports alone."""
        self._pinning = supply

    def charge_to(self, charges: Sequence["Charge"]) -> None:
        """From now on every group is charged to each GPU's ledger before its map is sent, and given
        back with its unmap (or its refusal): the ranks' pages are counted in their GPUs' accounts."""
        self._charges = list(charges)

    # ------------------------------------------------------ the Mapper role
    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def request_map(self, groups: Iterable[int]) -> None:
        groups = list(groups)
        if not groups:
            return
        if not self._charge(len(groups)):
            self.refused.extend(groups)  # the account said no: a scheduling miss, as a rank's refusal is
            return
        seq = self._next()
        for g in groups:
            self._pending[g] = seq
        self._sent[seq] = (tuple(groups), self._reports_seen)
        self._outbox.append(map_command(seq, groups))

    def request_unmap(self, groups: Iterable[int], after: Fence | None = None) -> None:
        """Unmap on every rank; ``after`` is moot: earlier copies precede this command on each rank."""
        groups = list(groups)
        if groups:
            self._give_back(sum(g in self.mapped_groups for g in groups))
            self.mapped_groups.difference_update(groups)
            self._outbox.append(unmap_command(self._next(), groups))

    def map_now(self, groups: list[int], *, force: bool = False) -> None:
        """No synchronous mapping across processes: the groups are requested and adopted later."""
        self.request_map(groups)

    # ------------------------------------------------------------- copies
    def request_store(self, block_ids: Sequence[int], slots: Sequence[int], block_compute: bool) -> None:
        self._outbox.append(store_command(self._next(), block_ids, slots, block_compute))

    def request_load(self, block_ids: Sequence[int], slots: Sequence[int], block_compute: bool = True) -> int:
        """The load's command number. ``block_compute=False``: the step's forward pass does not wait for it;
        every rank reports it done on a step's reply (see :meth:`load_done`)."""
        seq = self._next()
        if not block_compute:
            self._loads_out.add(seq)
        self._outbox.append(load_command(seq, block_ids, slots, block_compute))
        return seq

    def load_done(self, seq: int) -> bool:
        """Whether every rank reported asynchronous load ``seq`` done (answered once per load: then forgotten)."""
        if seq in self._loads_done:
            self._loads_done.discard(seq)
            return True
        return False

    def request_wait(self) -> None:
        """Every rank makes its next forward pass wait for the copies queued before this command."""
        self._outbox.append(wait_command(self._next()))

    def request_reserve(self, pages: int, change_bytes: int = 0) -> bool:
        """Every rank keeps ``pages`` unmapped pages warm (fewer driver calls on the next map);
        ``change_bytes``: how much more (or less) each rank then holds. False if the GPU's shared
        account refuses the growth (nothing is sent)."""
        if change_bytes > 0 and not self._charge(0, change_bytes):
            return False
        self._give_back(0, -change_bytes)
        self._outbox.append(reserve_command(self._next(), pages))
        return True

    # ---------------------------------------------------------- delivery
    def take_plan(self) -> StepPlan:
        """The commands queued since the last step, for the step being sent now."""
        self.steps += 1
        report = self.wants_report
        if report:
            self._pin_report_at = time.monotonic() + PIN_REPORT_PERIOD_S  # any report step brings the counts
        commands, self._outbox = tuple(self._outbox), []
        return StepPlan(step=self.steps, commands=commands, report=report)

    @property
    def pending_commands(self) -> int:
        return len(self._outbox)

    @property
    def pending_groups(self) -> int:
        """Groups asked for and not yet confirmed (or refused) by every rank."""
        return len(self._pending)

    # --------------------------------------------------------- confirmation
    def _refuse(self, failed: list[int]) -> None:
        if failed:
            self._give_back(len(failed))
            self.backoff_until = time.monotonic() + REFUSAL_BACKOFF_S
            self._outbox.append(unmap_command(self._next(), failed))  # ranks that did map give it back
            self.refused.extend(failed)
            log.debug("kvelastic: %d groups refused by a rank; they stay unmapped", len(failed))

    def adopt(self, report: StepReport) -> None:
        """Take one step's reports: each MAP every rank has now reported is split at the least count any
        rank mapped; a MAP left undecided for too many reports is refused."""
        self._reports_seen += 1
        for r in report.ranks:
            if r.device_free >= 0:
                self._rank_free[r.rank] = r.device_free
        self._rank_held = dict(enumerate(held_by_rank(report.ranks, self.world, self._rank_held)))
        if self._pinning is not None:
            self._pinning.take(report.ranks)
        self._count_loads(report)
        failed: list[int] = []
        for seq, done in self._tally.add(report).items():
            groups, _ = self._sent.pop(seq, ((), 0))
            mapped, refused = split_map(groups, done)
            for g in mapped:
                if self._pending.get(g) == seq:
                    del self._pending[g]
                    self.mapped_groups.add(g)
                    self.mapped.append(g)
            failed += [g for g in refused if self._pending.pop(g, None) == seq]
        stale = [seq for seq, (_, seen) in self._sent.items() if self._reports_seen - seen > MAX_REPORTS_WAITED]
        if stale:
            log.error("kvelastic: map commands %s were not reported by every rank; their groups are refused", stale)
            self._tally.drop(stale)
            for seq in stale:
                groups, _ = self._sent.pop(seq)
                for g in groups:
                    if self._pending.get(g) == seq:
                        del self._pending[g]
                        failed.append(g)
        self._refuse(failed)

    def _count_loads(self, report: StepReport) -> None:
        done = self._load_tally.add(report).keys() & self._loads_out
        self._loads_out -= done
        self._loads_done |= done

    @property
    def wants_report(self) -> bool:
        """True while a MAP or an asynchronous load awaits some rank's word, or (every
        :data:`PIN_REPORT_PERIOD_S`) while some rank still pins host slots: the next step must bring every
        rank's reply."""
        if self._sent or self._loads_out or any(c[1] == MAP for c in self._outbox):
            return True
        pinning = self._pinning
        return pinning is not None and not pinning.settled and time.monotonic() >= self._pin_report_at

    def backing_off(self) -> bool:
        """True shortly after a refusal: asking again would only fail."""
        return time.monotonic() < self.backoff_until

    def device_free_bytes(self) -> int | None:
        """The smallest free device memory any rank reported, or None if none reports it."""
        return min(self._rank_free.values()) if self._rank_free else None

    def rank_held_bytes(self) -> list[int]:
        """Physical bytes each rank's pool holds (mapped, waiting to be unmapped, warm), as last reported."""
        return [self._rank_held.get(rank, 0) for rank in range(self.world)]

    # ------------------------------------------------------------- helpers
    def _charge(self, groups: int, reserve_bytes: int = 0) -> bool:
        return charge_all(self._charges, groups, reserve_bytes)

    def _give_back(self, groups: int, reserve_bytes: int = 0) -> None:
        release_all(self._charges, groups, reserve_bytes)

    def _next(self) -> int:
        self._seq += 1
        return self._seq
