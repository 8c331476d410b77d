"""Idle delivery by an empty step: commands queued while the engine idles go out with a step of no tokens.

Under tensor parallelism the ranks apply the scheduler's commands with each
step's plan. While no request runs no step comes, so commands queued then
(unmaps of freed groups, spills before them, warm-reserve changes) would wait.
Where vLLM's engine loop can be woken (``EngineCoreProc``, vLLM 0.18+):

- the scheduler's ``has_requests()`` answers true while commands wait
  (``RankConnection.idle_work``, wrapped on the scheduler by its attachment),
  so vLLM's loop, once awake, runs a step with no tokens: ``schedule()``
  (whose step hook attaches the commands as the plan),
  ``execute_model`` on every rank (whose wrap applies the plan in order with
  the steps), ``update_from_output``;
- the reclaimer's tick posts the engine's wake-up (:class:`EngineWake`, handed
  to the scheduler as ``kvelastic_engine_wake``, where ``patches/engine_core_wake.py``
  finds it and registers the loop's input queue as the loop starts) while commands wait.

Nothing here waits: a post into vLLM's input queue never blocks, and a rank that
died fails the step as vLLM fails any step. Commands are never lost: until a
loop registers (the engine's start-up), and in an engine whose loop never does
(an in-process engine core, data parallelism over a MoE model, whose
``DPEngineCoreProc`` runs a loop of its own), they go with the next step, empty
or not; the latter is said once in the log.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("vllm.kvelastic")


class EngineWake:
    """How to wake this process's engine loop: registered by the loop as it starts, cleared as it ends."""

    def __init__(self) -> None:
        self._post: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def register(self, post: Callable[[], None]) -> None:
        """``post()`` puts a no-op request into the loop's input queue (never blocks)."""
        with self._lock:
            self._post = post

    def clear(self) -> None:
        with self._lock:
            self._post = None

    @property
    def ready(self) -> bool:
        """Whether an engine loop can be woken in this process."""
        return self._post is not None

    def wake(self) -> bool:
        """Wake the loop; False where none registered."""
        post = self._post
        if post is None:
            return False
        post()
        return True


class IdleSteps:
    """Carries the commands a mapper queued while idle on an empty step, where an engine loop can be woken.

    ``pending``: how many commands wait (the mapper's outbox). The engine
    thread reads :meth:`waiting` through ``has_requests`` without the
    scheduler's lock: a length read under the GIL, and a stale answer costs
    at most one empty step, or leaves the commands for the next step.
    """

    def __init__(self, pending: Callable[[], int], wake: EngineWake | None = None,
                 stepped: Callable[[], bool] = lambda: False):
        """``stepped``: whether the engine has run a step (its loop, if it has one, registered before)."""
        self._pending = pending
        self._stepped = stepped
        self.wake = wake if wake is not None else EngineWake()  # registered by the engine's loop, if it has one
        self.steps_asked = 0  # wake-ups posted (each asks for one empty step, if the loop idles)
        self._said_unwakeable = False

    def waiting(self) -> bool:
        """True while commands wait for a step and a woken loop would run one."""
        return self.wake.ready and self._pending() > 0

    def deliver(self) -> bool:
        """The reclaimer's tick: wake the loop if commands wait. True if they go by an empty step; False where
        nothing waits or no loop can be woken (then they go with the next step)."""
        if self._pending() <= 0:
            return False
        if not self.wake.wake():
            self._say_unwakeable()
            return False
        self.steps_asked += 1
        return True

    def _say_unwakeable(self) -> None:
        """Once: the engine has stepped, so its loop would have registered by now if it ever will."""
        if self._said_unwakeable or not self._stepped():
            return
        self._said_unwakeable = True
        log.warning("kvelastic: this engine's loop cannot be woken for a step of no tokens (an in-process engine "
                    "core, or data parallelism over a MoE model: vLLM's DPEngineCoreProc), so what the worker "
                    "ranks give back while it idles goes with its next step")

