"""Host-tier loads beside compute (``kvelastic.offload.plan``): what kvelastic sets and reads of vLLM.

vLLM runs a load while its request waits only for a KV connector, so kvelastic
puts its own scheduler-side connector (``kvelastic/hooks/host_loads.py``, a
subclass of the release's ``KVConnectorBase_V1``) on ``Scheduler.connector``
where vLLM made none, and hands vLLM the finished loads in the model runner's
output (``KVConnectorOutput``) that ``update_from_output`` receives. The
connector's methods are vLLM's to call, so their parameters are declared as
contacts too; so are the block pool's reference counts, which keep a loading
block from being reused, and the block hashes' group packing (the requests'
ids and block hashes: ``scheduler_block_pool.REQUEST``).

Version difference handled here: ``BlockPool.touch`` takes one sequence of
blocks per KV cache group up to 0.15, one flat sequence from 0.16
(:func:`hold_blocks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvelastic.patching.spec import Attributes, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import ALL, before, since

if TYPE_CHECKING:
    from kvelastic.patching.apply import Patcher

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_CALLED = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
           "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")
CONNECTOR_BASE = Target(  # read: kvelastic's connector derives from it (its defaults serve the rest)
    module=_BASE,
    qualname="KVConnectorBase_V1",
    kind="class",
    use="read",
    shapes=(Attributes(before("0.24"), _CALLED),
            Attributes(since("0.24"), (*_CALLED, "has_pending_push_work"))),
)
GET_NUM_NEW_MATCHED_TOKENS = Target(
    module=_BASE,
    qualname="KVConnectorBase_V1.get_num_new_matched_tokens",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "request", "num_computed_tokens")),),
)
UPDATE_STATE_AFTER_ALLOC = Target(
    module=_BASE,
    qualname="KVConnectorBase_V1.update_state_after_alloc",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "request", "blocks", "num_external_tokens")),),
)
BUILD_CONNECTOR_META = Target(
    module=_BASE,
    qualname="KVConnectorBase_V1.build_connector_meta",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "scheduler_output")),),
)
REQUEST_FINISHED = Target(
    module=_BASE,
    qualname="KVConnectorBase_V1.request_finished",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "request", "block_ids")),),
)
CONNECTOR_OUTPUT = Target(  # read: the finished loads and failed blocks handed to update_from_output
    module="vllm.v1.outputs",
    qualname="KVConnectorOutput",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("finished_recving", "invalid_block_ids")),),
)
MODEL_RUNNER_OUTPUT = Target(
    module="vllm.v1.outputs",
    qualname="ModelRunnerOutput",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("kv_connector_output",)),),
)
TOUCH = Target(  # read: a loading block gets one more reference, so it is never reused mid-copy
    module="vllm.v1.core.block_pool",
    qualname="BlockPool.touch",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "blocks")),),
)
FREE_BLOCKS = Target(
    module="vllm.v1.core.block_pool",
    qualname="BlockPool.free_blocks",
    kind="method",
    use="read",
    shapes=(Signature(before("0.23"), ("self", "ordered_blocks")),
            Signature(VersionRange.of("0.23", "0.24"), ("self", "ordered_blocks", "prepend")),
            Signature(VersionRange.of("0.24", "0.34"), ("self", "ordered_blocks")),
            Signature(since("0.34"), ("self", "ordered_blocks", "evict_first"))),  # evict_first defaults to False
)
HASH_WITH_GROUP = Target(  # read: the host tier's keys are block hashes packed with their group id
    module="vllm.v1.core.kv_cache_utils",
    qualname="make_block_hash_with_group_id",
    kind="function",
    use="read",
    shapes=(Signature(ALL, ("block_hash", "group_id")),),
)
KV_CACHE_BLOCKS = Target(
    module="vllm.v1.core.kv_cache_manager",
    qualname="KVCacheBlocks",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("blocks",)),),
)

TARGETS = (CONNECTOR_BASE, GET_NUM_NEW_MATCHED_TOKENS, UPDATE_STATE_AFTER_ALLOC, BUILD_CONNECTOR_META,
           REQUEST_FINISHED, CONNECTOR_OUTPUT, MODEL_RUNNER_OUTPUT, TOUCH, FREE_BLOCKS, HASH_WITH_GROUP,
           KV_CACHE_BLOCKS)


def hold_blocks(patcher: "Patcher", block_pool: Any) -> Callable[[Sequence[Any]], None]:
    """``hold(blocks)``: one more reference on each of ``blocks`` (one KV cache group's), as this release's
    ``BlockPool.touch`` takes them."""
    patcher.params(TOUCH)  # checked by the gate for this release
    if patcher.version in since("0.16"):
        return block_pool.touch
    return lambda blocks: block_pool.touch((blocks,))
