"""The host-load connector class itself, over the installed vLLM's ``KVConnectorBase_V1``.

Kept apart from :mod:`kvelastic.hooks.host_loads` because it imports vLLM at
module level (it must subclass the installed release's base, so every
scheduler-side method a release adds keeps its default): ``host_loads`` loads
this module only where the host tier's plan loads hits beside compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.outputs import KVConnectorOutput

from kvelastic.offload.async_loads import AsyncLoads, Retired


class HostLoads(KVConnectorBase_V1):
    """Serves host-tier runs of a request's prefix, beside the GPU prefix cache."""

    def __init__(self, loads: AsyncLoads, block_size: int, vllm_config: Any, kv_cache_config: Any):
        # KVConnectorBase_V1.__init__ is not called: it requires a kv_transfer_config, which kvelastic
        # does not set. These are the attributes its default methods read.
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = None
        self._kv_cache_config = kv_cache_config
        self._role = KVConnectorRole.SCHEDULER
        self.loads = loads
        self.block_size = block_size
        # request -> (first block, keys of the run, whether the run stopped at a key the host lacks)
        self._pending: dict[str, tuple[int, tuple, bool]] = {}
        self._settled = Retired()  # retired by a reset's wait, reported with the next output

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a lost load is a recompute, never a lost hand-off

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The host tier's run after the GPU hit, held on the host until vLLM allocated its blocks or
        ``schedule()`` ended (the allocation may spill GPU blocks into the tier); vLLM may ask again."""
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        keys = tuple(make_block_hash_with_group_id(h, 0) for h in request.block_hashes[first:last])
        run = self.loads.host_run(keys, request.request_id)
        self.loads.promise(request.request_id, keys[:run or 0])
        if run is None:
            self._pending.pop(request.request_id, None)
            return None, False
        missed = run < len(keys)
        self._pending[request.request_id] = (first, keys[:run], missed)
        return run * self.block_size, run > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: plan the load of the run into them. A run that stopped
        at a key the host lacks counts one host-tier miss, as the lookup in front of the step does."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return
        first, keys, missed = pending
        self.loads.tier.misses += missed
        if num_external_tokens == 0:
            return
        assert num_external_tokens == len(keys) * self.block_size, "internal: vLLM took another run"
        (group,) = blocks.blocks
        self.loads.plan(request.request_id, keys, group[first:first + len(keys)])

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return KVConnectorMetadata()  # nothing for workers: the loads ride kvelastic's copier

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._pending.pop(request.request_id, None)
        self.loads.forget(request.request_id)
        return False, None  # kvelastic holds a loading request's blocks itself

    def has_pending_push_work(self) -> bool:
        return self.loads.in_flight  # 0.24+: keep stepping until every load is retired

    # ----------------------------------------- kvelastic's side (OffloadManager.join)
    def issue(self) -> None:
        """End of ``schedule()``, after its spills: issue the loads it planned."""
        self.loads.issue()

    def settle(self) -> None:
        """Before the host tier is cleared: every load done; their requests are reported next step."""
        retired = self.loads.wait_all()
        self._settled.finished.extend(retired.finished)
        self._settled.invalid_block_ids |= retired.invalid_block_ids

    def stats(self) -> dict[str, Any]:
        c = self.loads.counters
        return {"reloaded_blocks": c.async_blocks, "host_loads_async": c.async_loads,
                "host_loads_failed": c.failed_loads,
                "host_loads_deferred": c.deferred_lookups, "host_async_loaded_blocks": c.async_blocks}

    def feed(self, scheduler: Any, model_runner_output: Any) -> Any:
        """``model_runner_output`` with the loads retired since the last step added to its connector
        output (a copy: vLLM shares one empty output object). Ids vLLM no longer tracks (a request
        aborted while loading, 0.12-0.15) are left out; their blocks were held and are now freed."""
        settled, self._settled = self._settled, Retired()
        retired = self.loads.retire()
        retired.finished += settled.finished
        retired.invalid_block_ids |= settled.invalid_block_ids
        finished = {rid for rid in retired.finished if rid in scheduler.requests}
        if not finished and not retired.invalid_block_ids:
            return model_runner_output
        base = model_runner_output.kv_connector_output
        output = KVConnectorOutput() if base is None else dataclasses.replace(base)
        output.finished_recving = set(output.finished_recving or ()) | finished
        output.invalid_block_ids = set(output.invalid_block_ids or ()) | retired.invalid_block_ids
        return dataclasses.replace(model_runner_output, kv_connector_output=output)

    # ------------------------------------------------------ no worker side
    def _no_worker(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("kvelastic's host-load connector has no worker side")

    start_load_kv = wait_for_layer_load = save_kv_layer = wait_for_save = _no_worker
