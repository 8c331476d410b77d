"""The scheduler side of a TP engine in front of rank processes, as one harness, and the helpers its tests share.

:class:`Cluster` is the real scheduler side (vLLM's ``BlockPool`` made page-aware
over the :class:`~kvelastic.tp.sharded_cache.ShardedKVCache` and
:class:`~kvelastic.tp.remote_mapper.RemoteMapper` of a
:class:`~kvelastic.tp.scheduler_side.RankConnection`) over the ranks of
``tests/tp_ranks.py``. It connects from the descriptions the ranks sent, as the
engine core's executor brings them back, and each step's replies reach the
scheduler merged as vLLM's executor merges them; it adopts a group only from
those reports.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvelastic.tp.protocol import StepPlan
from kvelastic.tp.step_report import StepReport
from tests.kv_fixtures import BS, LAYERS, N
from tests.tp_ranks import RankProcesses


class Cluster(RankProcesses):
    """The scheduler side plus rank processes (two, unless ``layers`` says otherwise)."""

    def __init__(self, limits=None, cpu_bytes=None, layers=(LAYERS, LAYERS), start_groups=None, host_slots: int = 0):
        from vllm.v1.core.block_pool import BlockPool

        from kvelastic.hooks.block_pool import make_page_aware
        from kvelastic.tp.scheduler_side import RankConnection
        from tests.scheduler_harness import scheduler_patcher

        super().__init__(limits, cpu_bytes, layers, start_groups=start_groups, host_slots=host_slots)
        self.connection = RankConnection(self.infos)
        self.cache, self.mapper = self.connection.cache, self.connection.mapper
        self.bp = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)
        self.queue = make_page_aware(self.bp, self.cache, self.mapper, patcher=scheduler_patcher(),
                                     max_ahead_groups=2)

    def run(self, plan: StepPlan, writes=(), checks=(), live=None, deliver=None) -> StepReport | None:
        """One step of ``plan``: sent to the ranks in ``live`` (default every rank), the replies of those in
        ``deliver`` (default every rank that ran it) merged and adopted as ``update_from_output`` adopts them.
        Returns the report adopted, if the plan asked for one."""
        self.send(plan, writes, checks, live)
        if not plan.report:
            return None
        merged = self.merged_report(plan, deliver)
        self.mapper.adopt(merged or StepReport())
        return merged

    def step(self, writes=(), checks=(), live=None, deliver=None, report: bool = False) -> StepReport | None:
        """The next step, carrying what the scheduler queued; ``report``: make it a report step whatever the
        scheduler asked."""
        plan = self.mapper.take_plan()
        if report:
            plan = dataclasses.replace(plan, report=True)
        return self.run(plan, writes, checks, live, deliver)

    def allocate(self, n: int) -> list | None:
        return allocate_or_ask(self.bp, self.queue, n)


def allocate_or_ask(bp, queue, n: int) -> list | None:
    """vLLM's check, then its allocation; None is a scheduling miss (the page-aware queue records the demand)."""
    if n > bp.get_num_free_blocks():
        queue.want_blocks(n)
        return None
    return bp.get_new_blocks(n)


def closed_after(make_one):
    """A fixture's body: yields a maker of harnesses (``make_one(**kw)``) and closes every one it made."""
    made = []

    def make(**kw):
        made.append(make_one(**kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster():
    yield from closed_after(lambda **kw: Cluster(**kw))


def allocate_within(c, n: int, steps: int = 5) -> list:
    """Allocate ``n`` blocks, running steps while the ranks map what the scheduler asked for."""
    for _ in range(steps):
        blocks = c.allocate(n)
        if blocks is not None:
            return blocks
        c.step()
    raise AssertionError(f"{n} blocks never became available")


def wait_for(condition, seconds: float = 10.0) -> bool:
    """Poll ``condition`` every 50 ms for up to ``seconds``; its last answer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
