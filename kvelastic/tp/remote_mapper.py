"""The scheduler side's :class:`~kvelastic.roles.Mapper` when the ranks hold the cache: commands to every rank.

The page-aware queue asks for groups to be mapped ahead of need and unmapped
once free, exactly as on one GPU. Here each request becomes a numbered command
in an outbox that the next step's ``SchedulerOutput`` carries to every rank
(:meth:`take_plan`). A group is reported ``mapped`` only when every rank's
board shows that command's number for it; if any rank refused it, it is
reported ``refused`` and unmapped everywhere. Nothing here ever waits for a
rank: an unconfirmed group is simply not handed out yet (a scheduling miss).

Confirmations come from one of two sources, chosen at construction: the
ranks' boards in shared memory (``BOARD``, one host), or the reports every rank
attaches to a step's reply (``STEP``, any host; :meth:`adopt`, fed by the
scheduler's ``update_from_output``). Either way a group is adopted only on every
rank's word. In ``STEP`` mode the mapper opens no board to start (the start-up
state comes in the ranks' descriptions: :mod:`kvelastic.tp.start_state`) and
learns how far each rank has pinned its host-tier share from the reports too
(:class:`~kvelastic.tp.host_supply.ReportedHostSupply`).

While the engine is idle no step runs, so :meth:`deliver_idle` (called by the
reclaimer) writes the outbox to the engine's folder for the ranks' idle
threads, but only when every step sent has been run by every rank: an unmap
must never overtake a step that still uses the group. In ``STEP`` mode with a
rank on another host no folder reaches every rank: the outbox then waits for
the engine's next step (an empty one where the loop can be woken).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Sequence

from kvelastic.errors import KvelasticError
from kvelastic.cluster.liveness import is_alive
from kvelastic.pool.backend import Fence
from kvelastic.roles import Mapper
from kvelastic.shared.errors import SharedFileError
from kvelastic.tp.gpu_charge import Charge, charge_all, release_all
from kvelastic.tp import board as shm
from kvelastic.tp.host_supply import ReportedHostSupply
from kvelastic.tp.protocol import (MAP, Command, StepPlan, load_command, map_command, reserve_command,
                                   store_command, unmap_command, wait_command)
from kvelastic.tp.start_state import StartState
from kvelastic.tp.step_report import CommandTally, StepReport, held_by_rank, split_map

log = logging.getLogger("vllm.kvelastic")

LIVENESS_PERIOD_S = 1.0
REFUSAL_BACKOFF_S = 0.5  # after a rank refused a group, ask for no new group for this long
MAX_REPORTS_WAITED = 8  # a MAP not decided by every rank after this many step reports is refused
PIN_REPORT_PERIOD_S = 0.1  # while a rank still pins its host-tier share, a report step at most this often

BOARD = "board"  # confirmations read off the ranks' shared-memory boards (one host)
STEP = "step"    # confirmations carried on the steps' replies (any host, any multiprocess executor)
AUTO = "auto"    # the setting's default: STEP where the executor gathers the replies, else BOARD


class RemoteMapper(Mapper):
    """Queues map/unmap/copy commands for all ranks and adopts groups every rank confirmed."""

    synchronous = False  # the queue must never wait for a map: it cannot be confirmed in the call

    def __init__(self, folder: Path, boards: Sequence[shm.RankBoard], start: StartState = StartState(),
                 confirm: str = BOARD, *, world: int | None = None,
                 open_boards: Callable[[], Sequence[shm.RankBoard]] | None = None):
        """``confirm``: ``BOARD`` (one board per rank) or ``STEP`` (no board: ``world`` ranks; idle delivery,
        which still goes through the engine's folder, opens them with ``open_boards`` when it first needs
        them; None in ``STEP`` mode: no folder reaches every rank, so idle commands wait for a step). ``start``:
        the groups to adopt and the command number to go on from. Every rank must confirm."""
        if confirm not in (BOARD, STEP):
            raise ValueError(f"confirmations come from {BOARD!r} or {STEP!r}, not {confirm!r}")
        self.folder = folder
        self.boards = list(boards)
        self.confirm = confirm
        self.world = len(self.boards) if world is None else world
        if confirm == BOARD and len(self.boards) != self.world:
            raise ValueError(f"{len(self.boards)} boards for {self.world} ranks")
        self._open_boards = open_boards
        #: whether commands queued while idle may go out as the engine folder's files (else: with a step)
        self.idle_through_folder = confirm == BOARD or open_boards is not None
        self._tally = CommandTally(self.world)
        self._sent: dict[int, tuple[tuple[int, ...], int]] = {}  # MAP seq -> (groups, reports seen when sent)
        self._reports_seen = 0
        self._loads_out: set[int] = set()  # asynchronous LOADs not yet reported done by every rank
        self._load_tally = CommandTally(self.world, entries=lambda report: ((seq, 1) for seq in report.loads))
        self._loads_done: set[int] = set()  # reported by every rank, not yet seen by their fence
        self._rank_free: dict[int, int] = {}
        self._rank_held: dict[int, int] = {}
        self._mapped: deque[int] = deque()
        self._refused: deque[int] = deque()
        self._outbox: list[Command] = []
        self._pending: dict[int, int] = {}  # group -> seq of the map command awaiting confirmation
        self.mapped_groups: set[int] = set(start.adopted)
        self._seq = start.applied
        self._pinning: ReportedHostSupply | None = None  # STEP mode with a host tier: the ranks' pinned slots
        self._pin_report_at = 0.0  # when a report step is next due for them, while some rank still pins
        self._steps = 0
        self._idle_upto = 0
        self._idle_written: list[tuple[int, Path]] = []  # idle files written here and not yet removed (last, path)
        self._next_liveness = 0.0
        self.dead_ranks: set[int] = set()
        self.backoff_until = 0.0
        self._seen_marks: tuple[int, ...] = ()
        self._charges: list[Charge] = []  # the GPUs' shared accounts, once the engine joined them

    def follow_pinning(self, supply: ReportedHostSupply) -> None:
        """Feed ``supply`` each report's pinned host slots (``STEP`` mode), and ask for a report step every
        :data:`PIN_REPORT_PERIOD_S` while some rank still pins: the supply grows from reports alone."""
        self._pinning = supply

    def charge_to(self, charges: Sequence["Charge"]) -> None:
        """From now on every group is charged to each GPU's ledger before its map is sent, and given
        back with its unmap (or its refusal): the ranks' pages are counted in their GPUs' accounts."""
        self._charges = list(charges)

    # ------------------------------------------------------ the Mapper role
    @property
    def mapped(self) -> deque[int]:
        if self._pending:
            self.poll()
        return self._mapped

    @property
    def refused(self) -> deque[int]:
        if self._pending:
            self.poll()
        return self._refused

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def request_map(self, groups: Iterable[int]) -> None:
        groups = list(groups)
        if not groups:
            return
        if not self._charge(len(groups)):
            self._refused.extend(groups)  # the account said no: a scheduling miss, as a rank's refusal is
            return
        seq = self._next()
        for g in groups:
            self._pending[g] = seq
        if self.confirm == STEP:
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
        every rank reports it done on a step's reply (``STEP`` mode only: see :meth:`load_done`)."""
        if not block_compute and self.confirm != STEP:
            raise KvelasticError("asynchronous host loads under tensor parallelism need the ranks' reports "
                                 "(KVELASTIC_TP_CONFIRM=step)")
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
        self._steps += 1
        report = self.wants_report
        if report:
            self._pin_report_at = time.monotonic() + PIN_REPORT_PERIOD_S  # any report step brings the counts
        commands, self._outbox = tuple(self._outbox), []
        return StepPlan(step=self._steps, commands=commands, idle_upto=self._idle_upto, report=report)

    def deliver_idle(self) -> bool:
        """Hand queued commands to idle ranks through files, if no step is in flight; True if sent. Where no
        folder reaches every rank (:attr:`idle_through_folder` false) nothing is written or read: the commands
        stay queued for the engine's next step, a scheduling delay, never a wait."""
        if not self.idle_through_folder:
            return False
        self._clean_idle_files()
        if not self._outbox or not self._idle_boards() or not self.no_step_in_flight():
            return False
        self._idle_written.append((self._outbox[-1][0], shm.write_idle_commands(self.folder, self._outbox)))
        self._idle_upto = self._outbox[-1][0]
        self._outbox = []
        return True

    def no_step_in_flight(self) -> bool:
        return all(b.get(shm.STEPS_DONE) >= self._steps for b in self.boards)

    def _idle_boards(self) -> list[shm.RankBoard]:
        """The boards idle delivery reads (in ``STEP`` mode too: it still goes through the engine's folder),
        opened at its first need in ``STEP`` mode; none where they cannot be: commands then wait for a step."""
        if not self.boards and self._open_boards is not None:
            opener, self._open_boards = self._open_boards, None
            try:
                self.boards = list(opener())
            except (OSError, SharedFileError) as error:
                log.warning("kvelastic: no idle delivery through %s (%s): commands queued while the engine "
                            "idles wait for its next step", self.folder, error)
        return self.boards

    @property
    def pending_commands(self) -> int:
        return len(self._outbox)

    @property
    def pending_groups(self) -> int:
        """Groups asked for and not yet confirmed (or refused) by every rank."""
        return len(self._pending)

    # --------------------------------------------------------- confirmation
    def poll(self) -> None:
        """Move groups every rank has mapped to ``mapped``, groups any rank refused to ``refused``.

        vLLM reads the free-block count a hundred times a step; a rank writes a
        group's state before it advances its applied mark, so while no mark
        moved there is nothing new to read.
        """
        if self.confirm == STEP:
            return  # nothing to read: reports arrive with the steps' replies (adopt)
        self._check_liveness()
        marks = tuple(b.get(shm.APPLIED) for b in self.boards)
        if marks == self._seen_marks and not self.dead_ranks:
            return
        self._seen_marks = marks
        applied = min(marks)
        failed: list[int] = []
        for g, seq in list(self._pending.items()):
            states = [int(b.groups[g]) for b in self.boards]
            if all(s == seq for s in states):
                del self._pending[g]
                self.mapped_groups.add(g)
                self._mapped.append(g)
            elif (applied >= seq and -seq in states) or self.dead_ranks:
                del self._pending[g]
                failed.append(g)
        self._refuse(failed)

    def _refuse(self, failed: list[int]) -> None:
        if failed:
            self._give_back(len(failed))
            self.backoff_until = time.monotonic() + REFUSAL_BACKOFF_S
            self._outbox.append(unmap_command(self._next(), failed))  # ranks that did map give it back
            self._refused.extend(failed)
            log.debug("kvelastic: %d groups refused by a rank; they stay unmapped", len(failed))

    def adopt(self, report: StepReport) -> None:
        """Take one step's reports (``STEP`` mode): each MAP every rank has now reported is split at the
        least count any rank mapped; a MAP left undecided for too many reports is refused."""
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
                    self._mapped.append(g)
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
        if self.confirm != STEP:
            return False
        if self._sent or self._loads_out or any(c[1] == MAP for c in self._outbox):
            return True
        pinning = self._pinning
        return pinning is not None and not pinning.settled and time.monotonic() >= self._pin_report_at

    def backing_off(self) -> bool:
        """True shortly after a refusal, or for good once a rank died: asking again would only fail."""
        return bool(self.dead_ranks) or time.monotonic() < self.backoff_until

    def device_free_bytes(self) -> int | None:
        """The smallest free device memory any rank reported, or None if none reports it."""
        if self.confirm == STEP:
            return min(self._rank_free.values()) if self._rank_free else None
        values = [b.get(shm.DEVICE_FREE) for b in self.boards]
        known = [v for v in values if v >= 0]
        return min(known) if known else None

    def rank_held_bytes(self) -> list[int]:
        """Physical bytes each rank's pool holds (mapped, waiting to be unmapped, warm), as last reported."""
        if self.confirm == STEP:
            return [self._rank_held.get(rank, 0) for rank in range(self.world)]
        return [b.get(shm.HELD_BYTES) for b in self.boards]

    # ------------------------------------------------------------- helpers
    def _charge(self, groups: int, reserve_bytes: int = 0) -> bool:
        return charge_all(self._charges, groups, reserve_bytes)

    def _give_back(self, groups: int, reserve_bytes: int = 0) -> None:
        release_all(self._charges, groups, reserve_bytes)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _check_liveness(self) -> None:
        now = time.monotonic()
        if now < self._next_liveness:
            return
        self._next_liveness = now + LIVENESS_PERIOD_S
        for rank, b in enumerate(self.boards):
            pid = b.get(shm.PID)
            if rank not in self.dead_ranks and pid and not is_alive(pid, 0):
                self.dead_ranks.add(rank)
                log.error("kvelastic: worker rank %d (pid %d) is gone; its groups will never be "
                          "confirmed, so no new KV memory is handed out", rank, pid)

    def _clean_idle_files(self) -> None:
        """Remove the idle files every rank has applied. This mapper is the folder's only writer of them
        (the folder is its engine's), so it removes from its own list: no listing of the folder on every
        reclaimer tick, under the scheduler's lock, for nothing (engine exit still lists it)."""
        if not self._idle_written:
            return
        applied = min(b.get(shm.APPLIED) for b in self.boards)
        for last, path in self._idle_written:
            if last <= applied:
                path.unlink(missing_ok=True)
        self._idle_written = [(last, path) for last, path in self._idle_written if last > applied]

