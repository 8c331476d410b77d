"""Map the groups an allocation needs before vLLM decides to make it.

The page-aware queue counts as free the blocks of groups it could still map,
judged from a free-memory reading up to 50 ms old (less a margin). vLLM's
``KVCacheManager.allocate_slots`` compares that count with what a request
needs and then commits (prefix blocks touched, blocks taken). If a process
outside kvelastic's accounting takes the memory in between, mapping fails in
``popleft_n``, after the commit, where the only answer left is an exception
that stops the engine.

The same holds where the limit or the GPU's shared account moved in between
(the account lowered this engine's cap, another engine took its grant): the
log line of a refusal says which of them refused (:func:`refusal_reason`).

vLLM asks ``coordinator.get_num_blocks_to_allocate(...)`` right before that
check in every supported release. :func:`install` wraps it on the scheduler's
coordinator instance: once vLLM knows how many blocks it wants, the queue maps
any it lacks now. A refusal then only lowers the free count vLLM reads next:
vLLM returns None (the request waits, or a running one is preempted) before
it changes anything. After a refusal no unmapped group is promised until the
step ends, so a preemption loop does not ask the device again and again; the
free-memory reading is refreshed for the next step.

Until the step ends (or ``popleft_n`` has taken them), empty groups are not
released as surplus: the blocks just secured must still be there when vLLM
takes them, also between the several ``popleft_n`` of a hybrid coordinator.

Admission checks ask about a whole sequence and allocate nothing: those map
nothing. How each release tells them apart (``apply_admission_cap=True`` from
0.20.2, ``can_fit_full_sequence`` in 0.19.0-0.20.1) is handled in one place,
``patches/admission_check.py``, which also declares the estimate's parameters.

Under tensor parallelism (``mapper.synchronous`` False) the estimate is not
wrapped at all: the queue promises only groups every rank has confirmed, so no
estimate can fail, and mapping waits for the ranks a step later, so there is
nothing to map on it. Nothing needs holding either: there the queue balances
(and so releases empty groups) only at the step's end and in the reclaimer,
never on an allocation or a free within the step (``_balance_within_step``),
so the groups vLLM counted are still there when it takes them. The wrap would
only cost a Python call per request per step (about 0.15 of the 0.54 ms a
step kvelastic added to ``schedule()`` in the CPU model of the commit guard's tests). Demand is requested after each
step from the scheduler's queues, see :func:`kvelastic.tp.scheduler_side.demand_of`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvelastic.cluster.errors import SharedBudgetExceeded
from kvelastic.errors import DeviceOutOfMemory, PoolExhausted, PoolLimitExceeded
from kvelastic.patches.admission_check import ESTIMATE, flag_index, is_admission_check

if TYPE_CHECKING:
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.patching.apply import Patcher

log = logging.getLogger("vllm.kvelastic")

LOG_EVERY_S = 10.0  # an outsider may hold the memory for many steps: one line per stretch, not per step


class CommitGuard:
    """Secures, on vLLM's estimate, the blocks its next allocation will take."""

    def __init__(self, queue: PageAwareFreeQueue):
        self.queue = queue
        self.admitting = 0  # depth of admission checks in progress (nothing to secure in them)
        self.refusals = 0   # estimates the pool proved wrong (limit, account or device), for logs and tests
        self._next_log = 0.0

    def secure(self, blocks: int) -> None:
        """vLLM will take ``blocks`` free blocks if the free count allows: map what is missing now."""
        if self.admitting:  # a whole-sequence check: map nothing, but a request it declines waits
            self.queue.note_shortfall(blocks)
            return
        hold = self.queue.hold
        hold.secured = blocks
        if blocks <= 0:  # most estimates of a decode step (once per request per step): nothing to map
            return
        if not self.queue.map_for(blocks):  # it also made the next estimate read the device afresh
            hold.refused = True
            self.refusals += 1
            self._log_refusal(blocks)

    def _log_refusal(self, blocks: int) -> None:
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + LOG_EVERY_S
            log.info("kvelastic: a page group the free-block estimate promised was refused by %s; an "
                     "allocation of %d blocks waits as a scheduling miss (%d refusals so far)",
                     refusal_reason(self.queue.cache.last_refusal), blocks, self.refusals)

    @contextlib.contextmanager
    def admission(self) -> Iterator[None]:
        """A whole-sequence admission check runs inside: it allocates nothing, so nothing is mapped."""
        self.admitting += 1
        try:
            yield
        finally:
            self.admitting -= 1

    def end_step(self) -> None:
        self.queue.hold.end_step()


def refusal_reason(refusal: PoolExhausted | None) -> str:
    """Who refused, in words: the estimate reads the limit, the shared account and the device, and
    any of them can have moved since (a lowered limit or fair share, another engine's grant, a
    process outside kvelastic), so the log must not blame the device for the others."""
    if isinstance(refusal, PoolLimitExceeded):
        return f"this engine's limit ({refusal})"
    if isinstance(refusal, SharedBudgetExceeded):
        return f"the GPU's shared account ({refusal})"
    if isinstance(refusal, DeviceOutOfMemory):
        return f"the device: a process outside kvelastic's accounting took the memory ({refusal})"
    return f"the pool ({refusal or 'no reason recorded'})"


def install(coordinator: Any, queue: PageAwareFreeQueue, patcher: Patcher) -> CommitGuard:
    """Wrap ``coordinator.get_num_blocks_to_allocate`` on this instance only, where the queue maps
    synchronously (not under TP: see the module's docstring); return the guard."""
    guard = CommitGuard(queue)
    if queue.mapper.synchronous:
        flag_at = flag_index(patcher.params(ESTIMATE))
        patcher.wrap_instance(coordinator, ESTIMATE, functools.partial(_estimate, guard, flag_at))
    patcher.add_attribute(coordinator, "kvelastic_guard", guard)
    return guard


def guard_of(kv_cache_manager: Any) -> CommitGuard | None:
    """The guard of this manager's coordinator; None where kvelastic did not attach to it (a CPU pool's)."""
    return getattr(kv_cache_manager.coordinator, "kvelastic_guard", None)


def _estimate(guard: CommitGuard, flag_at: int | None, wrapped: Any, instance: Any, args: tuple,
              kwargs: dict) -> int:
    blocks = wrapped(*args, **kwargs)
    if is_admission_check(flag_at, args, kwargs):
        guard.queue.note_shortfall(blocks)  # nothing to map; a request it declines waits for memory
    else:
        guard.secure(blocks)
    return blocks
