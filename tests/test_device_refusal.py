"""A process outside kvelastic's accounting takes GPU memory between the estimate and the allocation.

The page-aware queue promises vLLM blocks in groups it could still map, judged
from a free-memory reading up to 50 ms old. Another process may take that
memory before the groups are mapped. Here vLLM's real Scheduler drives a
host-backed cache whose device an "outsider" fills at a chosen step, unseen by
any free-memory reading (the worst case of a stale one): the request that
needed the memory must wait (a scheduling miss) instead of crashing the
engine, and run once the memory is back, with vanilla's outputs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.errors import DeviceOutOfMemory
from kvelastic.pool import HostBackend
from kvelastic.settings import Settings
from tests.kv_fixtures import GROUP_BYTES, build_cache
from tests.scheduler_harness import (
    check_every_step,
    drive,
    drive_async,
    make_requests,
    PatchedSchedulers,
    make_scheduler,
    wait_unmapped,
)

ARRIVES = 2     # the second request arrives after this many steps, when the outsider takes the device
GIVES_BACK = 17  # ... and the outsider gives the memory back after this many


class OutsiderBackend(HostBackend):
    """A host device that another process can fill at any moment, unseen by its free-memory reading."""

    def __init__(self) -> None:
        super().__init__()
        self.outsider = False
        self.refusals = 0

    def create_page(self, nbytes: int):
        if self.outsider:
            self.refusals += 1
            raise DeviceOutOfMemory("another process holds the device's memory", requested_bytes=nbytes)
        return super().create_page(nbytes)


@pytest.fixture
def outsider(tmp_path, monkeypatch):
    """A factory of patched schedulers over an OutsiderBackend; torn down after the test."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    schedulers = PatchedSchedulers()

    def make(asynchronous: bool = False):
        backend = OutsiderBackend()
        pool, views, cache = build_cache(backend=backend)
        settings = Settings(enabled=True, reserve_bytes=0)  # no warm pages: every map creates
        return schedulers.make(pool, views, cache, settings, asynchronous), pool, backend

    yield make
    schedulers.close()


def _requests() -> tuple[list, list]:
    """r-0 fits in group 0 (with vLLM's null block); s-0, arriving later, needs a group more."""
    return (make_requests("r", 1, 400, 0, seed=5, max_tokens=60),
            make_requests("s", 1, 640, 0, seed=6, max_tokens=10))


def _run(scheduler, asynchronous: bool, on_step) -> tuple[list, dict]:
    first, second = _requests()
    steps: list[int] = []

    def after(s) -> None:
        steps.append(1)
        on_step(s, len(steps))
        if len(steps) == ARRIVES:
            s.add_request(second[0])

    trace = (drive_async if asynchronous else drive)(scheduler, [first], after_step=after)
    return trace, {r.request_id: list(r.output_token_ids) for r in first + second}


def _take_the_device(scheduler, pool, backend: OutsiderBackend) -> None:
    """The outsider takes every byte kvelastic has not mapped, empty groups mapped ahead included."""
    backend.outsider = True
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    with scheduler.kvelastic_reclaimer.lock:
        queue.set_idle()  # the empty groups mapped ahead go back to the device ...
    wait_unmapped(pool, GROUP_BYTES)
    pool.trim_reserve(0)  # ... and so do their pages: the next map must create pages, and is refused


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_memory_taken_by_another_process_makes_a_request_wait_not_the_engine_crash(outsider, asynchronous):
    vanilla_trace, vanilla_outputs = _run(make_scheduler(asynchronous=asynchronous), asynchronous,
                                          lambda s, step: None)
    scheduler, pool, backend = outsider(asynchronous)
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    checks = check_every_step(pool)

    def on_step(s, step: int) -> None:
        checks(s)
        if step == ARRIVES:
            _take_the_device(s, pool, backend)
        elif step == GIVES_BACK:
            backend.outsider = False

    trace, outputs = _run(scheduler, asynchronous, on_step)
    waited = trace[ARRIVES:GIVES_BACK]
    assert backend.refusals > 0, "the device was never asked while the outsider held it"
    assert not any(rid == "s-0" for step in waited for rid, _ in step), "s-0 ran on memory nobody could map"
    assert any(rid == "r-0" for step in waited for rid, _ in step), "the running request stopped too"
    assert any(rid == "s-0" for step in trace[GIVES_BACK:] for rid, _ in step), "s-0 never ran"
    assert any(rid == "s-0" for step in vanilla_trace[ARRIVES:GIVES_BACK] for rid, _ in step)
    assert outputs == vanilla_outputs
    assert len(outputs["s-0"]) == 10 and len(outputs["r-0"]) == 60
    assert not scheduler.has_unfinished_requests()
    assert queue.num_in_use == 1  # vLLM's null block only: nothing leaked
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == queue.num_total - 1  # all obtainable
