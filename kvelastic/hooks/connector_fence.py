"""vLLM's offload connector beside the page-aware pool: who owns offload, and the fence on its copies.

A page group is unmapped only once no block in it is in use, and the unmap
waits for the GPU work queued on blocking streams. A connector copies on
streams of its own, so what keeps its copies' pages mapped must come from the
scheduler side, where kvelastic decides to release a group:

- **SimpleCPUOffloadConnector** (eager, lazy, disk) pins every GPU block it
  copies with ``BlockPool.touch`` when it plans the copy and frees it when the
  workers report the copy done (also after a reset). Its lazy walk over free
  blocks touches what it picks in the same scheduling call, under the lock the
  reclaimer takes. A pinned block is in use, so its group stays mapped; no more
  is needed.
- **OffloadingConnector** (lru, arc) lets vLLM free a request's blocks while a
  store still reads them (from 0.21 on finish; on preemption in every release)
  and flushes the store before vLLM *reuses* such a block. Unmapping is not
  reuse, so here groups that got a block back while the connector had transfers
  in flight, or a finished request whose last stores it has yet to plan, are
  held: not released, idle or not, until the connector has nothing in flight.

kvelastic's own host tier (``KVELASTIC_CPU_BYTES``) and a vLLM offload
connector would both move the same blocks; that configuration is refused.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvelastic.errors import KvelasticError
from kvelastic.patches.offload_connectors import (OFFLOADING_CONNECTOR, SIMPLE_CONNECTOR, is_a,
                                                  offload_in_flight)
from kvelastic.patching.apply import Patcher

log = logging.getLogger("vllm.kvelastic")


class OffloadOwnerConflict(KvelasticError):
    """kvelastic's host tier and one of vLLM's offload connectors are both configured."""


def offload_connector_name(connector: Any) -> str | None:
    """``"OffloadingConnector"`` or ``"SimpleCPUOffloadConnector"`` for those connectors; None otherwise."""
    for target in (OFFLOADING_CONNECTOR, SIMPLE_CONNECTOR):
        if connector is not None and is_a(connector, target):
            return target.qualname
    return None


def check_offload_owner(connector: Any, cpu_bytes: int | None) -> None:
    """Refuse kvelastic's host tier beside one of vLLM's offload connectors: one of them must own offload."""
    name = offload_connector_name(connector)
    if name is not None and cpu_bytes:
        raise OffloadOwnerConflict(
            f"kvelastic: KVELASTIC_CPU_BYTES (kvelastic's host tier) and vLLM's {name} would both offload "
            f"the same KV blocks; use one: unset KVELASTIC_CPU_BYTES to keep vLLM's connector, or drop "
            f"--kv-offloading-size / the kv_transfer_config to use kvelastic's host tier")


def may_walk_free_queue(connector: Any) -> bool:
    """Whether ``connector`` may walk the GPU free queue itself, so the page-aware queue must keep its order.

    SimpleCPUOffloadConnector's lazy mode does; no other code reads the order,
    and keeping it costs work on every block taken or freed. A connector
    kvelastic does not know might, so any connector keeps it.
    """
    return connector is not None


def transfers_in_flight(scheduler: Any, patcher: Patcher) -> Callable[[], bool] | None:
    """What the page-aware queue asks before releasing groups freed meanwhile; None where pins suffice."""
    connector = scheduler.connector
    if connector is None or is_a(connector, SIMPLE_CONNECTOR):
        return None
    if is_a(connector, OFFLOADING_CONNECTOR):
        side = connector.connector_scheduler

        def busy() -> bool:
            return bool(scheduler.finished_req_ids) or offload_in_flight(patcher, side)

        return busy
    log.warning("kvelastic: KV connector %s is not one kvelastic knows; its copies are fenced only by the "
                "blocks it keeps in use (untested)", type(connector).__name__)
    return None
