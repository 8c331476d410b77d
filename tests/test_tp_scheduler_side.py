"""The scheduler-side step hook under TP: what the waiting and running requests ask for, and the plan."""

from __future__ import annotations

import functools
import threading
import types

from kvelastic.tp.protocol import MAP, StepPlan
from kvelastic.hooks.scheduler import locked_wrapper
from kvelastic.tp.scheduler_side import demand_of, end_step


def request(tokens: int, computed: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_tokens=tokens, num_computed_tokens=computed)


def scheduler(waiting=(), running=(), block_size: int = 16) -> types.SimpleNamespace:
    return types.SimpleNamespace(waiting=list(waiting), running=list(running),
                                 cache_config=types.SimpleNamespace(block_size=block_size))


def test_demand_is_what_every_request_still_computes_and_a_block_per_decoding_one():
    s = scheduler(waiting=[request(33), request(100, computed=64)], running=[request(5, computed=4)] * 3)
    assert demand_of(s) == 3 + 3 + 3  # ceil(33/16) + ceil(36/16) + one per decoding request
    assert demand_of(scheduler(running=[request(1)] * 2)) == 2
    chunked = request(16000, computed=8192)  # a long prompt half prefilled: its next chunks need blocks
    assert demand_of(scheduler(running=[chunked])) == -(-(16000 - 8192) // 16)
    assert demand_of(scheduler()) == 0


class RecordingMapper:
    def __init__(self) -> None:
        self.steps = 0
        self.outbox: list = []

    def take_plan(self) -> StepPlan:
        self.steps += 1
        commands, self.outbox = tuple(self.outbox), []
        return StepPlan(step=self.steps, commands=commands)


class RecordingQueue:
    def __init__(self, mapper: RecordingMapper) -> None:
        self.mapper = mapper
        self.wanted: list[int] = []

    def want_blocks(self, blocks: int) -> None:
        self.wanted.append(blocks)
        if blocks:
            self.mapper.outbox.append((len(self.mapper.outbox) + 2, MAP, (1,)))


def test_each_step_carries_the_commands_queued_by_its_own_scheduling_and_flush():
    mapper = RecordingMapper()
    queue = RecordingQueue(mapper)
    s = scheduler(waiting=[request(40)])
    flushed: list[int] = []
    plan = functools.partial(end_step, s, queue, mapper)  # what the connection to the ranks hooks onto each step
    wrapper = locked_wrapper(threading.RLock(), lambda: flushed.append(1), plan)

    def schedule():  # as the wrapped instance method is called
        return wrapper(types.SimpleNamespace, s, (), {})

    first = schedule()
    assert flushed == [1] and queue.wanted == [3]
    assert first.kvelastic_plan.step == 1 and [c[1] for c in first.kvelastic_plan.commands] == [MAP]
    s.waiting.clear()
    second = schedule()
    assert queue.wanted == [3, 0]  # no demand left: the next call says so, releasing what it held
    assert second.kvelastic_plan.step == 2 and second.kvelastic_plan.commands == ()
