"""The host tier's memory pinned in the background: slots arrive as chunks complete (CPU, real threads).

A fake pinner stands in for ``cuMemHostRegister``: each chunk's pin waits for
the test to release it, or fails where the test says, so every ordering the
scheduler can see is reproduced without a GPU.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest

from kvelastic.offload.host_memory import PAGE, HostMemory, PinError, chunk_plan
from kvelastic.offload.staged_copy import slot_runs
from kvelastic.offload.host_tier import HostTier, HostTierError, allocate_slots
from kvelastic.tp.host_supply import ReportedHostSupply
from kvelastic.tp.step_report import RankReport, StepReport

SLOT = PAGE  # one slot per page: chunks of whole slots are page-aligned with no rounding
CHUNK = 4 * SLOT  # background chunks of 4 slots; the head chunk is 1 slot


class GatedPinner:
    """Pins chunk 0 at once; every later chunk waits for :meth:`release` (or fails from ``fail_at`` on)."""

    def __init__(self, fail_at: int | None = None):
        self.base: int | None = None
        self.fail_at = fail_at
        self.pinned: list[int] = []
        self.unpinned: list[int] = []
        self._open = 0  # chunks 1.._open may pin
        self._lock = threading.Condition()

    def release(self, chunks: int = 1) -> None:
        """Let the next ``chunks`` background chunks (in chunk order) pin."""
        with self._lock:
            self._open += chunks
            self._lock.notify_all()

    def pin(self, address: int, nbytes: int) -> None:
        if self.base is None:
            self.base = address  # the head chunk, pinned in the constructor
        index = self.index(address)
        with self._lock:
            if not self._lock.wait_for(lambda: index <= self._open, timeout=10):
                raise AssertionError("the test never released this chunk")
        if self.fail_at is not None and index >= self.fail_at:
            raise PinError("out of pinned memory (fake)")
        with self._lock:
            self.pinned.append(index)

    def unpin(self, address: int) -> None:
        with self._lock:
            self.unpinned.append(self.index(address))

    def index(self, address: int) -> int:
        assert self.base is not None
        offset = address - self.base
        return 0 if offset == 0 else 1 + (offset - SLOT) // CHUNK


def memory(slots: int, pinner: GatedPinner, threads: int = 2) -> HostMemory:
    return HostMemory(slots, SLOT, pinner=pinner, chunk_bytes=CHUNK, head_bytes=SLOT, threads=threads)


def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_chunks_hold_whole_slots_and_start_on_pages():
    for slot_bytes in (PAGE, 3 * PAGE, 1000, 2 * 1024 * 1024, 5):
        plan = chunk_plan(1000, slot_bytes, chunk_bytes=64 * PAGE, head_bytes=PAGE)
        assert plan[0][0] == 0 and plan[-1][1] == 1000
        assert all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
        assert all(first * slot_bytes % PAGE == 0 for first, _ in plan)
    assert chunk_plan(100, SLOT, CHUNK, SLOT)[:3] == [(0, 1), (1, 5), (5, 9)]
    unit = PAGE // math.gcd(1000, PAGE)
    assert chunk_plan(10 * unit, 1000, 1, 1)[0] == (0, unit)  # never less than one page-aligned unit


def test_without_a_pinner_every_slot_is_ready_at_once():
    mem = HostMemory(10, SLOT, pinner=None)
    assert mem.ready_slots == 10 and mem.settled and mem.buffer.shape == (10, SLOT)
    tier = HostTier(10 * SLOT, SLOT, pin=False)
    assert tier.stats().slots == 10 and tier.memory is not None and tier.memory.settled


def test_slots_appear_as_chunks_complete():
    pinner = GatedPinner()
    mem = memory(13, pinner)  # chunks: [0,1) [1,5) [5,9) [9,13)
    assert mem.ready_slots == 1 and not mem.settled  # the head chunk is pinned before the constructor returns
    tier = HostTier(13 * SLOT, SLOT, pin=False, allocate=False, supply=mem)
    assert tier.stats().slots == 1
    assert tier.admit("a") == 0
    assert tier.admit("b") == 0 and "a" not in tier  # one slot: the policy replaces within what is pinned
    pinner.release()
    until(lambda: mem.ready_slots >= 5)
    slots = [tier.admit(k) for k in "cdef"]  # drained at the next admission
    assert sorted(slots) == [1, 2, 3, 4] and tier.stats().slots == 5
    pinner.release(2)
    assert mem.wait(10) and mem.ready_slots == 13 and mem.failure is None
    tier.admit("g")
    assert tier.stats().slots == 13 and tier._supply is None  # settled: no more polling
    assert sorted(pinner.pinned) == [0, 1, 2, 3] and pinner.unpinned == []


def test_admission_before_any_slot_is_pinned_misses_without_blocking():
    class Nothing:
        ready_slots = 0
        settled = False

    supply = Nothing()
    tier = HostTier(8 * SLOT, SLOT, pin=False, allocate=False, supply=supply)
    start = time.perf_counter()
    assert tier.admit("a") is None and "a" not in tier and tier.lookup("a") is None
    assert time.perf_counter() - start < 0.1
    tier.clear()
    assert tier.stats().slots == 0 and tier.stats().slots_used == 0
    supply.ready_slots = 3
    assert tier.admit("a") == 0 and tier.lookup("a") == 0 and tier.stats().slots == 3


def test_the_write_through_share_comes_out_of_the_pinned_slots_before_the_policy_gets_any():
    """Copies stored ahead have their share of the slots pinned so far; the policy grows with the rest."""
    class Growing:
        ready_slots = 0
        settled = False

    supply = Growing()
    tier = HostTier(10 * SLOT, SLOT, pin=False, allocate=False, supply=supply, ahead_slots=3)
    supply.ready_slots = 2
    assert tier.admit("k") is None and tier.policy is None  # all of it is the ahead share so far
    assert tier.free_slot() == 0  # ...which write-through may use
    supply.ready_slots, supply.settled = 10, True
    assert tier.admit("k") is not None and tier.policy is not None and tier.policy.capacity == 7
    assert tier.stats().slots == 10 and tier.stats().slots_used == 2


def test_failure_midway_leaves_a_smaller_working_tier(caplog):
    pinner = GatedPinner(fail_at=2)
    mem = memory(17, pinner, threads=1)  # [0,1) [1,5) | [5,9) fails
    pinner.release(4)
    with caplog.at_level(logging.WARNING, logger="vllm.kvelastic"):
        assert mem.wait(10)
    assert mem.ready_slots == 5 and mem.pinned_bytes == 5 * SLOT and "out of pinned memory" in mem.failure
    warnings = [r for r in caplog.records if "pinned only" in r.getMessage()]
    assert len(warnings) == 1 and "works with the 5 blocks" in warnings[0].getMessage()
    tier = HostTier(17 * SLOT, SLOT, pin=False, allocate=False, supply=mem)
    slots = {tier.admit(k) for k in range(20)}  # more keys than slots: evictions, never a slot past 5
    assert slots - {None} <= set(range(5)) and tier.stats().slots == 5 and tier.evicted == 15


def test_chunks_pinned_past_a_failed_one_are_given_back():
    class LateFailure(GatedPinner):
        """Chunk 2 fails only once chunk 3 (another thread's) is pinned: a gap in the prefix."""

        def pin(self, address: int, nbytes: int) -> None:
            if self.base is not None and self.index(address) == 2:
                until(lambda: 3 in self.pinned)
                raise PinError("refused (fake)")
            super().pin(address, nbytes)

    pinner = LateFailure()
    mem = memory(17, pinner, threads=2)
    pinner.release(8)
    assert mem.wait(10)
    assert mem.ready_slots == 5 and 3 in pinner.unpinned and min(pinner.unpinned) == 3  # past the gap: unusable


def test_close_stops_the_threads_and_keeps_what_is_pinned():
    pinner = GatedPinner()
    mem = memory(41, pinner, threads=2)
    pinner.release(2)
    until(lambda: mem.ready_slots >= 5)
    mem.close(timeout=0.2)  # the threads are waiting on chunks 3 and 4 (or in them)
    pinner.release(2)  # let the chunks in progress finish; nothing new starts
    assert mem.wait(10) and mem.settled and mem.failure is None
    assert not any(t.is_alive() for t in mem._threads)
    assert 5 <= mem.ready_slots < 41 and len(pinner.pinned) <= 5


def test_free_unpins_everything():
    pinner = GatedPinner()
    mem = memory(9, pinner)
    pinner.release(2)
    assert mem.wait(10)
    mem.free()
    assert sorted(pinner.unpinned) == [0, 1, 2] and mem.ready_slots == 0 and mem.buffer is None


def test_a_host_that_cannot_pin_at_all_fails_at_start_up(monkeypatch):
    pinner = GatedPinner(fail_at=0)
    with pytest.raises(PinError):
        memory(9, pinner)

    class Refuses:
        def __init__(self, device=None):
            pass

        def pin(self, address, nbytes):
            raise PinError("RLIMIT_MEMLOCK (fake)")

    monkeypatch.setattr("kvelastic.offload.host_tier.CudaPinner", Refuses)
    with pytest.raises(HostTierError, match="lower KVELASTIC_CPU_BYTES"):
        allocate_slots(9, SLOT, pin=True)


def test_watchers_see_every_step_and_the_end():
    pinner = GatedPinner()
    mem = memory(9, pinner, threads=1)
    seen: list[tuple[int, bool]] = []
    mem.watch(lambda ready, settled: seen.append((ready, settled)))
    pinner.release(2)
    assert mem.wait(10)
    assert seen == [(1, False), (5, False), (9, False), (9, True)]


def _reported(rank: int, ready: int, settled: bool = False) -> StepReport:
    return StepReport((RankReport(rank=rank, applied=0, step=1, host_ready=ready, host_settled=settled),))


def test_ranks_hand_out_a_slot_only_once_every_rank_reported_it():
    supply = ReportedHostSupply(2)
    tier = HostTier(10 * SLOT, SLOT, pin=False, allocate=False, supply=supply)
    assert tier.admit("a") is None  # no rank has reported yet
    supply.take(_reported(0, 6).ranks)
    assert tier.admit("a") is None  # rank 1 has reported nothing pinned
    supply.take(_reported(1, 2).ranks)
    assert tier.admit("a") == 0 and tier.stats().slots == 2
    supply.take(_reported(1, 1).ranks)  # an older report never shrinks what a rank has pinned
    assert supply.ready_slots == 2
    supply.take(_reported(0, 10, True).ranks + _reported(1, 8, True).ranks)  # rank 1 stopped short
    tier.admit("b")
    assert tier.stats().slots == 8 and tier._supply is None


def test_staged_runs_end_where_a_chunk_begins():
    pinner = GatedPinner()
    mem = memory(13, pinner)  # chunks [0,1) [1,5) [5,9) [9,13)
    assert mem.breaks == {1, 5, 9}
    assert list(slot_runs([3, 4, 5, 6, 0, 1], mem.breaks)) == [(0, 3, 2), (2, 5, 2), (4, 0, 1), (5, 1, 1)]
    assert HostMemory(4, SLOT, pinner=None).breaks == frozenset()
    pinner.release(3)
    assert mem.wait(10)


class RecordingPinner(GatedPinner):
    """Records which threads pin, and refuses (as the driver does) while a "capture" is under way."""

    def __init__(self):
        super().__init__()
        self.capturing = False
        self.threads: set[str] = set()

    def pin(self, address: int, nbytes: int) -> None:
        if self.capturing:
            raise PinError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (fake)")
        self.threads.add(threading.current_thread().name)
        super().pin(address, nbytes)


def test_deferred_pinning_starts_only_when_begun_and_a_capture_before_it_is_undisturbed():
    pinner = RecordingPinner()
    pinner.release(10)
    mem = HostMemory(9, SLOT, pinner=pinner, chunk_bytes=CHUNK, head_bytes=SLOT, threads=2, deferred=True)
    assert pinner.pinned == [0] and mem.ready_slots == 1  # the head, on the constructing thread
    pinner.capturing = True  # vLLM captures its CUDA graphs: no thread of ours may register memory
    time.sleep(0.05)
    assert pinner.pinned == [0] and not mem.settled and not mem.wait(0.01)
    pinner.capturing = False
    mem.begin()
    mem.begin()  # once
    assert mem.wait(10) and mem.failure is None and mem.ready_slots == 9
    assert sorted(pinner.pinned) == [0, 1, 2] and pinner.threads - {threading.current_thread().name}


def test_deferred_pinning_never_begun_closes_on_what_the_head_pinned():
    pinner = RecordingPinner()
    mem = HostMemory(9, SLOT, pinner=pinner, chunk_bytes=CHUNK, head_bytes=SLOT, deferred=True)
    mem.close(timeout=1)
    assert mem.settled and mem.ready_slots == 1 and pinner.pinned == [0]
    mem.begin()  # too late: nothing starts
    assert pinner.pinned == [0] and not any(t.is_alive() for t in mem._threads)
