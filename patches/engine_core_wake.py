"""Engine core: let kvelastic wake an idle engine loop, so commands queued while idle ride an empty step.

Under tensor parallelism, commands the
scheduler queues while no step runs (unmaps of freed groups, spills before
them, warm-reserve changes) go to the ranks with the next step's plan. vLLM's
engine loop (``EngineCoreProc.run_busy_loop``) blocks on its input queue while
``has_work()`` is false, and ``has_work()`` asks ``scheduler.has_requests()``.
So kvelastic makes ``has_requests()`` true while commands wait
(``kvelastic.tp.idle_steps``, wrapped on the scheduler by its attachment) and
posts vLLM's ``WAKEUP`` (a no-op request every release from 0.18 handles) into
that queue: the loop wakes and runs a step with no tokens, whose plan every rank
applies in order with the steps. vLLM itself steps with no tokens whenever
finished requests are to be flushed, and from 0.24 while a connector has push
work (``Scheduler.has_requests``).

The wrap of ``run_busy_loop`` only registers how to post into this engine's
queue with the scheduler's :class:`~kvelastic.tp.idle_steps.EngineWake` (the
attribute ``kvelastic_engine_wake``, which kvelastic's attachment puts on the
scheduler of worker ranks only), then runs vLLM's loop unchanged; an engine whose
scheduler has none runs the loop as it is. Data parallelism with MoE runs
``DPEngineCoreProc``'s own loop (its steps coordinate waves across engines), which
is not wrapped: no registration, so idle commands go with the next step there, as
in an in-process engine (no loop to wake). Before 0.18 (no ``WAKEUP``) worker
ranks are refused at start-up (``kvelastic/tp/executor_handover.py``).
Facts and releases: docs/tensor-parallel.md, "What vLLM offers".
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Absent, Attributes, Patch, Signature, Target
from kvelastic.patches._common import ALL, before, since

_CORE = "vllm.v1.engine.core"
_FROM = since("0.18")  # EngineCoreRequestType.WAKEUP exists, handled as a no-op by the engine loop

BUSY_LOOP = Target(  # wrapped: registers this engine's wake-up, then vLLM's loop as it is
    module=_CORE,
    qualname="EngineCoreProc.run_busy_loop",
    kind="method",
    shapes=(Signature(_FROM, ("self",)),),
)
ENGINE_CORE_PROC = Target(  # read: the queue the loop blocks on while it has no work
    module=_CORE,
    qualname="EngineCoreProc",
    kind="class",
    use="read",
    shapes=(Attributes(_FROM, ("input_queue",)),),
)
ENGINE_CORE = Target(  # read: the engine's scheduler, on which kvelastic's attachment left the wake-up
    module=_CORE,       # (and the hibernation, patches/sleep_mode.py: every release)
    qualname="EngineCore",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("scheduler",)),),
)
REQUEST_TYPE = Target(  # read: the request posted to wake the loop
    module="vllm.v1.engine",
    qualname="EngineCoreRequestType",
    kind="class",
    use="read",
    shapes=(Attributes(_FROM, ("WAKEUP",)),),
)
TARGETS = (BUSY_LOOP, ENGINE_CORE_PROC, ENGINE_CORE, REQUEST_TYPE)

# The scheduler's side (wrapped on the scheduler object by its attachment, ``kvelastic/hooks/scheduler.py``;
# declared among ``scheduler_block_pool``'s targets): ``has_requests`` is the interface's up to 0.23, and
# vLLM's Scheduler overrides it from 0.24 (connector push work). The gate reads a class's own methods only.
INTERFACE_HAS_REQUESTS = Target(
    module="vllm.v1.core.sched.interface",
    qualname="SchedulerInterface.has_requests",
    kind="method",
    use="instance",
    shapes=(Signature(ALL, ("self",)),),
)
SCHEDULER_HAS_REQUESTS = Target(
    module="vllm.v1.core.sched.scheduler",
    qualname="Scheduler.has_requests",
    kind="method",
    use="instance",
    shapes=(Absent(before("0.24")), Signature(since("0.24"), ("self",))),
)
SCHEDULER_TARGETS = (INTERFACE_HAS_REQUESTS, SCHEDULER_HAS_REQUESTS)


def has_requests_target(patcher: Any) -> Target:
    """The declaration that covers ``has_requests`` in the running release (its own class's)."""
    return SCHEDULER_HAS_REQUESTS if patcher.declares(SCHEDULER_HAS_REQUESTS) else INTERFACE_HAS_REQUESTS


#: The scheduler attribute kvelastic's attachment sets to the engine's wake-up (worker ranks only).
WAKE_ATTRIBUTE = "kvelastic_engine_wake"


def _run_busy_loop(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    wake = getattr(instance.scheduler, WAKE_ATTRIBUTE, None)
    if wake is None:  # no commands for idle ranks in this engine: vLLM's loop as it is
        return wrapped(*args, **kwargs)
    from vllm.v1.engine import EngineCoreRequestType

    wake.register(functools.partial(instance.input_queue.put_nowait, (EngineCoreRequestType.WAKEUP, None)))
    try:
        return wrapped(*args, **kwargs)
    finally:
        wake.clear()


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(BUSY_LOOP, _run_busy_loop)


PATCH = Patch("engine_core_wake", "Engine core: kvelastic may wake the idle loop (idle commands on an empty step)",
              _FROM, TARGETS, apply)
