"""Scheduler: make the GPU block pool page-aware, lock the entry points, start the reclaimer.

The patch wraps ``Scheduler.__init__`` on the class; everything else happens
on the new scheduler's own objects in ``attach_scheduler``
(``kvelastic/hooks/scheduler.py``), through the same Patcher, so it is
undone with the rest and all of it is undone if attaching fails. The patch's
targets are every vLLM contact of that scheduler side, declared here and in
the modules named below, and checked by the gate before anything changes:

- ``block_pool_queue``: the block pool, its free queue, the blocks;
- ``admission_check``: the block estimate the commit guard wraps;
- ``host_tier_lookup``: the prefix-cache map the host tier answers from;
- ``engine_config``: the configuration read;
- ``offload_connectors``: vLLM's offload connector the scheduler made, if any;
- ``host_loads``: kvelastic's own connector for host loads beside compute, its outputs;
- ``engine_core_wake``: ``has_requests``, true while commands wait for idle ranks (worker ranks);
- here: the scheduler itself, its entry points, and the requests it queues.

Version differences handled here: ``Scheduler.__init__`` takes ``hash_block_size``
from 0.20; ``schedule`` takes ``throttle_prefills`` from 0.24 and
``reset_prefix_cache`` takes ``reset_connector`` from 0.13 (the lock wrappers pass
every argument through; the declarations make the gate notice a new one).
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Attributes, Patch, Signature, Target
from kvelastic.patches import (admission_check, block_pool_queue, engine_config, engine_core_wake, host_loads,
                               host_tier_lookup, offload_connectors)
from kvelastic.patches._common import ALL, before, since

_SCHEDULER = "vllm.v1.core.sched.scheduler"
_INIT = ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size")
SCHEDULER_INIT = Target(
    module=_SCHEDULER,
    qualname="Scheduler.__init__",
    kind="method",
    shapes=(Signature(before("0.20"), (*_INIT, "mm_registry", "include_finished_set", "log_stats")),
            Signature(since("0.20"), (*_INIT, "hash_block_size", "mm_registry", "include_finished_set",
                                      "log_stats"))),
)
SCHEDULER = Target(  # what the attachment, the tensor-parallel step hook and the host loads read; ``connector``
    module=_SCHEDULER,  # is set to kvelastic's own where vLLM made none and host loads run beside compute
    qualname="Scheduler",
    kind="class",
    use="instance",
    shapes=(Attributes(ALL, ("kv_cache_manager", "vllm_config", "cache_config", "running", "waiting", "connector",
                             "finished_req_ids", "requests", "block_size", "kv_cache_config")),),
)
SCHEDULE = Target(  # the entry points below take the lock shared with the reclaimer thread
    module=_SCHEDULER,
    qualname="Scheduler.schedule",
    kind="method",
    use="instance",
    shapes=(Signature(before("0.24"), ("self",)), Signature(since("0.24"), ("self", "throttle_prefills"))),
)
UPDATE_FROM_OUTPUT = Target(
    module=_SCHEDULER,
    qualname="Scheduler.update_from_output",
    kind="method",
    use="instance",
    shapes=(Signature(ALL, ("self", "scheduler_output", "model_runner_output")),),
)
FINISH_REQUESTS = Target(
    module=_SCHEDULER,
    qualname="Scheduler.finish_requests",
    kind="method",
    use="instance",
    shapes=(Signature(ALL, ("self", "request_ids", "finished_status")),),
)
RESET_PREFIX_CACHE = Target(
    module=_SCHEDULER,
    qualname="Scheduler.reset_prefix_cache",
    kind="method",
    use="instance",
    shapes=(Signature(before("0.13"), ("self", "reset_running_requests")),
            Signature(since("0.13"), ("self", "reset_running_requests", "reset_connector"))),
)
REQUEST = Target(  # read: under tensor parallelism, what the queued requests still need to compute; the
    module="vllm.v1.request",  # host loads' runs of block hashes
    qualname="Request",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("num_tokens", "num_computed_tokens", "request_id", "block_hashes")),),
)

#: The scheduler's methods that read or change the GPU block pool, called by the engine thread.
LOCKED = (SCHEDULE, UPDATE_FROM_OUTPUT, FINISH_REQUESTS, RESET_PREFIX_CACHE)
TARGETS = (SCHEDULER_INIT, SCHEDULER, *LOCKED, REQUEST, *block_pool_queue.TARGETS, admission_check.ESTIMATE,
           *host_tier_lookup.TARGETS, *engine_config.TARGETS, *offload_connectors.TARGETS, *host_loads.TARGETS,
           *engine_core_wake.SCHEDULER_TARGETS)


def _init(runtime: Any, patcher: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    from kvelastic.hooks.scheduler import attach_scheduler

    wrapped(*args, **kwargs)
    attach_scheduler(instance, runtime, patcher)


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(SCHEDULER_INIT, functools.partial(_init, runtime, patcher))


PATCH = Patch("scheduler_block_pool", "Scheduler: page-aware GPU block pool, reclaimer thread", ALL, TARGETS, apply)
