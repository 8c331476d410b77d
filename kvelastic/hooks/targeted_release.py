"""Targeted release on vLLM's scheduler (``KVELASTIC_RELEASE=preempt``, docs/targeted-release.md).

When the reclaimer finds the pool over its limit in groups running requests
hold (``PageAwareFreeQueue.shrink_by``), the next ``schedule()`` call first
preempts the requests :func:`~kvelastic.scheduler.release_plan.choose_victims`
names, so those groups hold no block in use, and gives them back before the
call goes on (else it would hand their blocks to the waiting requests). It
happens here, at the start of ``schedule()``, on the engine thread and under
the scheduler lock, where vLLM's own between-steps
preemption (``reset_prefix_cache``) happens too; never from the reclaimer's
thread, since vLLM changes a request's state outside the lock as well.

Each victim goes through vLLM's ``_preempt_request`` (never a copy of it),
leaves the set of requests scheduled in the previous step (so a resume resends
all its tokens), and is kept out of the waiting queue for this one call, as
vLLM keeps the requests it preempts itself: with a step still in flight
(async scheduling) its token arrives before it can be resumed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvelastic.errors import ConfigError
from kvelastic.scheduler.release_plan import choose_victims

if TYPE_CHECKING:
    from kvelastic.patching.apply import Patcher
    from kvelastic.roles import SchedulerCache
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue

log = logging.getLogger("vllm.kvelastic")
#: At most this share of the running requests is preempted by one reading (at least one request).
MAX_VICTIM_SHARE = 0.5
#: Seconds between two log lines about targeted releases (each says how many so far).
LOG_EVERY_S = 10.0


class TargetedRelease:
    """The ``schedule()`` wrapper (wrapt's form) that preempts the holders of the groups to give back."""

    def __init__(self, scheduler: Any, queue: "PageAwareFreeQueue", cache: "SchedulerCache", patcher: "Patcher"):
        from kvelastic.patches.targeted_release import PREEMPT_REQUEST, REPORTED_BY_VLLM

        self.scheduler = scheduler
        self.queue = queue
        self.cache = cache
        self.drop_param = "drop_stale_output" in patcher.params(PREEMPT_REQUEST)
        self.report_ids = patcher.version not in REPORTED_BY_VLLM
        self.preempted = 0  # requests preempted so far
        self.released_groups = 0  # groups given back right after
        self._seen = queue.shrink_ticks
        self._logged = -LOG_EVERY_S

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        victims = self._preempt()
        try:
            out = wrapped(*args, **kwargs)
        finally:
            for request in reversed(victims):  # back at the head of the waiting queue, in their order
                self.scheduler.waiting.prepend_request(request)
        if victims and self.report_ids:
            out.preempted_req_ids = set(out.preempted_req_ids or ()) | {r.request_id for r in victims}
        return out

    def _preempt(self) -> list[Any]:
        if self.queue.shrink_ticks == self._seen:
            return []  # acted on this reading already: the reclaimer gives the groups back first
        self._seen = self.queue.shrink_ticks
        groups = self.queue.excess_blocks // self.cache.blocks_per_group
        if groups <= 0:
            return []
        victims = self._choose(groups)
        scheduler, now = self.scheduler, time.monotonic()
        for request in reversed(victims):  # each goes to the waiting queue's head: the last first
            scheduler.running.remove(request)
            if self.drop_param:
                scheduler._preempt_request(request, now, drop_stale_output=scheduler.requires_kv_delivery)
            else:
                scheduler._preempt_request(request, now)
            scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
        for request in victims:
            scheduler.waiting.remove_request(request)  # not resumed by this very call
        self.preempted += len(victims)
        if victims:  # give the emptied groups back now, before this call hands their blocks to others
            self.released_groups += self.queue.reclaim_cached(groups_wanted=groups)
            if now - self._logged >= LOG_EVERY_S:
                self._logged = now
                log.info("kvelastic: over the limit by %d group(s): preempted %d running request(s) holding them "
                         "(%d so far, %d groups given back so far)", groups, len(victims), self.preempted,
                         self.released_groups)
        return victims

    def _choose(self, groups: int) -> list[Any]:
        manager = self.scheduler.kv_cache_manager
        blocks = manager.block_pool.blocks
        running = {r.request_id: r for r in self.scheduler.running}
        blocks_of = {rid: [b for ids in manager.get_block_ids(rid) for b in ids if not blocks[b].is_null]
                     for rid in running}
        chosen = choose_victims(blocks_of, lambda b: blocks[b].ref_cnt, self.cache.group_of_block, groups,
                                max(1, int(len(running) * MAX_VICTIM_SHARE)))
        return [running[rid] for rid in chosen]


def install_targeted_release(scheduler: Any, queue: "PageAwareFreeQueue", cache: "SchedulerCache",
                             patcher: "Patcher", *, local: bool, vllm_connector: bool) -> TargetedRelease:
    """Wrap ``scheduler``'s ``schedule`` (inside the lock's wrapper, which goes around it after).
    ``vllm_connector``: vLLM made a KV connector (not kvelastic's own host loads)."""
    from kvelastic.patches.scheduler_block_pool import SCHEDULE
    from kvelastic.patches.targeted_release import REPORTED_BY_VLLM

    if vllm_connector and patcher.version not in REPORTED_BY_VLLM:
        raise ConfigError(f"KVELASTIC_RELEASE=preempt beside a KV connector needs vLLM {REPORTED_BY_VLLM.low} or "
                          f"newer (before, the connector builds its step's metadata without the preempted "
                          f"requests); this is {patcher.version}: unset it")
    if not local:
        raise ConfigError("KVELASTIC_RELEASE=preempt is not built yet where the KV cache lives in worker "
                          "processes (tensor parallelism, or the multiprocess executor): an unmap there must "
                          "wait for the ranks' step; unset it (memory then drains as requests finish)")
    release = TargetedRelease(scheduler, queue, cache, patcher)
    patcher.wrap_instance(scheduler, SCHEDULE, release)
    log.info("kvelastic: over its limit, this engine preempts the requests holding the groups it gives back "
             "(KVELASTIC_RELEASE=preempt)")
    return release
