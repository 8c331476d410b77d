"""Targeted release (``KVELASTIC_RELEASE=preempt``): what kvelastic calls and reads of vLLM's scheduler.

At the start of ``schedule()`` (kvelastic's wrapper, on the engine thread, under
the scheduler lock) the requests holding blocks in the page groups an engine
over its limit must give back are preempted with vLLM's own
``_preempt_request``, kept out of the waiting queue for that one call, and
reported to the workers (``kvelastic/hooks/targeted_release.py``; the facts per
release are in docs/targeted-release.md).

Version differences handled here: ``_preempt_request`` takes
``drop_stale_output`` from 0.27 (before, an in-flight step's token is
delivered normally, and the one-call parking keeps the request from being
resumed before it arrives); from 0.25 every ``_preempt_request`` is reported
in the next ``SchedulerOutput.preempted_req_ids`` by vLLM itself, before that
the hook adds the ids.
"""

from __future__ import annotations

from kvelastic.patching.spec import Attributes, Signature, Target
from kvelastic.patches._common import ALL, before, since

_SCHEDULER = "vllm.v1.core.sched.scheduler"
PREEMPT_REQUEST = Target(
    module=_SCHEDULER,
    qualname="Scheduler._preempt_request",
    kind="method",
    use="read",
    shapes=(Signature(before("0.27"), ("self", "request", "timestamp")),
            Signature(since("0.27"), ("self", "request", "timestamp", "drop_stale_output"))),
)
SCHEDULER_STEP_STATE = Target(  # read: the resend bookkeeping a preemption between steps must update
    module=_SCHEDULER,
    qualname="Scheduler",
    kind="class",
    use="read",
    shapes=(Attributes(before("0.27"), ("prev_step_scheduled_req_ids",)),
            Attributes(since("0.27"), ("prev_step_scheduled_req_ids", "requires_kv_delivery"))),
)
GET_BLOCK_IDS = Target(
    module="vllm.v1.core.kv_cache_manager",
    qualname="KVCacheManager.get_block_ids",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "request_id")),),
)
_QUEUE = "vllm.v1.core.sched.request_queue"
REMOVE_REQUEST = Target(
    module=_QUEUE,
    qualname="RequestQueue.remove_request",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "request")),),
)
PREPEND_REQUEST = Target(
    module=_QUEUE,
    qualname="RequestQueue.prepend_request",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "request")),),
)
SCHEDULER_OUTPUT = Target(
    module="vllm.v1.core.sched.output",
    qualname="SchedulerOutput",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("preempted_req_ids",)),),
)
KV_CACHE_BLOCK = Target(
    module="vllm.v1.core.kv_cache_utils",
    qualname="KVCacheBlock",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("block_id", "ref_cnt", "is_null")),),
)

#: Releases whose ``_preempt_request`` puts the request in the next output's ``preempted_req_ids`` itself.
REPORTED_BY_VLLM = since("0.25")

TARGETS = (PREEMPT_REQUEST, SCHEDULER_STEP_STATE, GET_BLOCK_IDS, REMOVE_REQUEST, PREPEND_REQUEST, SCHEDULER_OUTPUT,
           KV_CACHE_BLOCK)
