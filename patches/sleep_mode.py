"""Engine core: vLLM's sleep, wake and ``release_kv_cache_memory`` move kvelastic's KV pages too.

vLLM frees the KV cache on sleep (levels 1 and 2) and on ``release_kv_cache_memory``
(0.31+) through its own allocator pool, which holds none of kvelastic's pages. Each
call is wrapped on the engine core, where the scheduler and, in a one-GPU engine,
the page pool live: once vLLM's own method has run (from 0.17 it pauses the
scheduler and resets the prefix cache first; before, ``LLM.sleep`` resets it),
the engine's :class:`~kvelastic.scheduler.hibernation.Hibernation` gives every
page back but the null block's group. A sleep that waits for requests to finish
(vLLM returns a future) gives them back once it is done. ``wake_up`` with the
``kv_cache`` tag (or none) gives the pool its limit back; groups map as requests
use them.

Under worker ranks (tensor or pipeline parallelism) the pages are given back by
commands on the ranks' steps, and a sleeping engine runs none: a sleep that frees
memory (level 1 or 2) and the release are refused before vLLM's method changes
anything (and ``--enable-sleep-mode`` at start-up, ``kvelastic/worker/sleep_mode.py``).
A pause (level 0) frees nothing and is left alone.
"""

from __future__ import annotations

import inspect
from concurrent.futures import Future
from typing import Any

from kvelastic.patching.spec import Absent, Patch, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import ALL, before, since
from kvelastic.patches.engine_core_wake import ENGINE_CORE

_CORE = "vllm.v1.engine.core"
#: The scheduler attribute kvelastic's attachment sets: the engine's hibernation, or None under worker ranks.
HIBERNATION_ATTRIBUTE = "kvelastic_hibernation"
_ABSENT = object()

SLEEP = Target(
    module=_CORE,
    qualname="EngineCore.sleep",
    kind="method",
    shapes=(Signature(VersionRange.of("0.12", "0.17"), ("self", "level")),
            Signature(VersionRange.of("0.17", "0.34"), ("self", "level", "mode")),
            Signature(since("0.34"), ("self", "level", "mode", "reset_connector"))),
)
WAKE_UP = Target(module=_CORE, qualname="EngineCore.wake_up", kind="method",
                 shapes=(Signature(ALL, ("self", "tags")),))
RELEASE = Target(
    module=_CORE,
    qualname="EngineCore.release_kv_cache_memory",
    kind="method",
    shapes=(Absent(before("0.31")), Signature(VersionRange.of("0.31", "0.34"), ("self",)),
            Signature(since("0.34"), ("self", "reset_connector"))),
)


def _hibernation(engine_core: Any, call: str) -> Any:
    """The engine's hibernation; ``_ABSENT`` where kvelastic did not attach its scheduler. Under worker
    ranks (None) the call is refused here, before vLLM's method runs."""
    hibernation = getattr(engine_core.scheduler, HIBERNATION_ATTRIBUTE, _ABSENT)
    if hibernation is None:
        from kvelastic.worker.sleep_mode import refuse_under_ranks

        refuse_under_ranks(call)
    return hibernation


def _level(wrapped: Any, args: tuple, kwargs: dict) -> int:
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    return int(bound.arguments["level"])


def _sleep(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    level = _level(wrapped, args, kwargs)
    if level < 1:
        return wrapped(*args, **kwargs)  # level 0 pauses scheduling only: nothing is freed
    hibernation = _hibernation(instance, "sleep")
    result = wrapped(*args, **kwargs)
    if hibernation is _ABSENT:
        return result
    if isinstance(result, Future):
        result.add_done_callback(lambda done: done.exception() is None and hibernation.sleep())
    else:
        hibernation.sleep()
    return result


def _wake_up(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    hibernation = getattr(instance.scheduler, HIBERNATION_ATTRIBUTE, None)
    tags = inspect.signature(wrapped).bind(*args, **kwargs).arguments.get("tags")
    if hibernation is not None and (tags is None or "kv_cache" in tags):
        hibernation.wake()  # before vLLM resumes scheduling (in its wake_up, from 0.31)
    return wrapped(*args, **kwargs)


def _release(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    hibernation = _hibernation(instance, "release_kv_cache_memory")
    result = wrapped(*args, **kwargs)
    if hibernation is not _ABSENT:
        hibernation.sleep()
    return result


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(SLEEP, _sleep)
    patcher.wrap(WAKE_UP, _wake_up)
    if patcher.declares(RELEASE):
        patcher.wrap(RELEASE, _release)


PATCH = Patch("sleep_mode", "Engine core: sleep, wake_up and release_kv_cache_memory give back and take again "
              "kvelastic's KV pages", ALL, (SLEEP, WAKE_UP, RELEASE, ENGINE_CORE), apply)
