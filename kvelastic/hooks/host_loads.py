"""kvelastic's scheduler-side KV connector: host-tier hits loaded while their request waits.

vLLM runs an asynchronous load only for a connector: the request is admitted
with ``get_num_new_matched_tokens`` returning ``(tokens, True)``, waits in
``WAITING_FOR_REMOTE_KVS``, and is scheduled once its id comes back in
``KVConnectorOutput.finished_recving`` (docs/offload.md, "How a host hit comes back"). Setting a
``kv_transfer_config`` would change vLLM's configuration well beyond that and
take the user's connector slot, so kvelastic instead puts this object on
``Scheduler.connector`` where vLLM made none. The loads ride kvelastic's own
copier (:mod:`kvelastic.offload.async_loads`); :meth:`HostLoads.feed` hands
vLLM their completions as the model runner's connector output would.

The class (:mod:`kvelastic.hooks.host_loads_connector`) derives from the
installed release's ``KVConnectorBase_V1``, so every scheduler-side method a
release adds keeps its default; this module imports it, and so vLLM, only on
first use. Only the scheduler role exists; the
worker methods refuse, since no worker ever gets this connector.

:func:`attach_host_loads` installs it where the host tier's plan loads hits
beside compute (:mod:`kvelastic.offload.plan`), through the Patcher, on
contacts ``patches/host_loads.py`` declares; one KV cache group. Under tensor
parallelism that is where the ranks report their loads on the steps' replies: a
load is done once every rank said so.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kvelastic.offload.async_loads import AsyncLoads
from kvelastic.patches._common import argument

if TYPE_CHECKING:
    from kvelastic.offload.manager import OffloadManager
    from kvelastic.patching.apply import Patcher


def connector_class() -> type:
    """The connector class over the installed vLLM's ``KVConnectorBase_V1`` (imports vLLM: first use only)."""
    from kvelastic.hooks.host_loads_connector import HostLoads

    return HostLoads


def make_host_loads(loads: AsyncLoads, scheduler: Any) -> Any:
    """The connector for ``scheduler`` (vLLM's ``Scheduler``), over ``loads``; not yet installed."""
    return connector_class()(loads, scheduler.block_size, scheduler.vllm_config, scheduler.kv_cache_config)


def attach_host_loads(scheduler: Any, offload: "OffloadManager", patcher: "Patcher") -> Any:
    """kvelastic's connector on ``scheduler`` over ``offload``'s tier and copier, joined to ``offload``'s
    step (the caller checked that the plan loads hits beside compute)."""
    from kvelastic.patches.host_loads import hold_blocks
    from kvelastic.patches.scheduler_block_pool import SCHEDULER

    block_pool = scheduler.kv_cache_manager.block_pool
    loads = AsyncLoads(offload.tier, offload.copier, hold_blocks(patcher, block_pool), block_pool.free_blocks,
                       runs=offload.runs)
    connector = make_host_loads(loads, scheduler)
    patcher.replace_attribute(scheduler, SCHEDULER, "connector", connector)
    offload.join(connector)
    return connector


class InFrontWhenAlone:
    """The choice at each GPU prefix miss where hits load beside compute: the host tier serves it in front
    of the step (``OffloadManager.load_on_miss``) when the request looked up is alone, with nothing
    running, nothing else waiting and no load in flight; otherwise the connector loads it while the
    request waits.

    A load beside compute pays for hiding the copy: the request waits at least one more step, and its
    blocks are allocated (each page group mapped) before any of the copy starts. With nothing else to run,
    there is nothing to hide it behind; in front of the step the copy of one page group runs while the
    next is mapped (H200: a 16k-token 8B prefix reloaded into an idle engine in 72 ms in front of the
    step, 105 ms beside compute).
    """

    def __init__(self, scheduler: Any, loads: AsyncLoads):
        self._scheduler = scheduler  # vLLM's Scheduler: ``running`` and ``waiting`` (declared to the gate)
        self._loads = loads

    def __call__(self) -> bool:
        scheduler = self._scheduler
        # the request being looked up is still in ``waiting`` (vLLM pops it once scheduled)
        return not scheduler.running and len(scheduler.waiting) <= 1 and not self._loads.in_flight


def feeding_wrapper(connector: Any, scheduler: Any) -> Any:
    """A wrapper (wrapt's form) for ``update_from_output`` that hands vLLM the finished loads."""
    return functools.partial(_fed, connector, scheduler)


def _fed(connector: Any, scheduler: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    scheduled = argument(wrapped, args, kwargs, "scheduler_output")
    output = argument(wrapped, args, kwargs, "model_runner_output")
    return wrapped(scheduled, connector.feed(scheduler, output))
