"""The scheduler's GPU ``BlockPool``, made page-aware on its instance (``hooks/block_pool.py``).

Its free queue is replaced by ``PageAwareFreeQueue``, and three methods whose
meaning depends on "free" are wrapped on that one object; the CPU pool of an
offload connector in the same process keeps vLLM's own. Declared here: what
is replaced or wrapped, what is read to build the queue, and the members vLLM
uses on the free queue, which the replacement must offer.

Version differences handled here: ``BlockPool.evict_blocks`` exists from
0.13.0; ``free_block_queue.prepend_n`` is used from 0.23.0.
"""

from __future__ import annotations

from kvelastic.patching.spec import Absent, Attributes, Signature, Target
from kvelastic.patching.versions import Version, VersionRange
from kvelastic.patches._common import ALL, before, since

KV_CACHE_MANAGER = Target(  # read: the scheduler's manager leads to the GPU pool and the coordinator
    module="vllm.v1.core.kv_cache_manager",
    qualname="KVCacheManager",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("block_pool", "coordinator")),),
)
BLOCK_POOL = Target(  # free_block_queue is replaced on the instance; the rest is read
    module="vllm.v1.core.block_pool",
    qualname="BlockPool",
    kind="class",
    use="instance",
    shapes=(Attributes(ALL, ("num_gpu_blocks", "blocks", "free_block_queue", "cached_block_hash_to_block")),),
)
RESET_PREFIX_CACHE = Target(  # wrapped on the instance: unmapped blocks count as free while vLLM checks
    module="vllm.v1.core.block_pool",
    qualname="BlockPool.reset_prefix_cache",
    kind="method",
    use="instance",
    shapes=(Signature(ALL, ("self",)),),
)
GET_USAGE = Target(  # wrapped on the instance: usage of what is physically obtainable
    module="vllm.v1.core.block_pool",
    qualname="BlockPool.get_usage",
    kind="method",
    use="instance",
    shapes=(Signature(ALL, ("self",)),),
)
EVICT_BLOCKS = Target(  # wrapped on the instance where it exists: evicted blocks change group
    module="vllm.v1.core.block_pool",
    qualname="BlockPool.evict_blocks",
    kind="method",
    use="instance",
    shapes=(Absent(before("0.13")), Signature(since("0.13"), ("self", "block_ids"))),
)
EVICT_CACHED = Target(  # read: the page-aware queue evicts cached blocks through it
    module="vllm.v1.core.block_pool",
    qualname="BlockPool._maybe_evict_cached_block",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "block")),),
)
ALL_FREE_BLOCKS = Target(  # read once: vLLM's free blocks seed the page-aware queue
    module="vllm.v1.core.kv_cache_utils",
    qualname="FreeKVCacheBlockQueue.get_all_free_blocks",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self",)),),
)
KV_CACHE_BLOCK = Target(  # read by the queue and the host tier on every block it handles
    module="vllm.v1.core.kv_cache_utils",
    qualname="KVCacheBlock",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("block_id", "block_hash", "is_null")),),  # is_null: write-through skips the null block
)

_QUEUE_MEMBERS = ("popleft", "popleft_n", "append_n", "remove", "num_free_blocks")
#: What vLLM's own code (``vllm/v1/core``) uses on ``BlockPool.free_block_queue``, per release. The
#: version matrix checks that each release's source uses nothing more, and the tests that the
#: page-aware queue offers all of it.
FREE_QUEUE_MEMBERS: tuple[tuple[VersionRange, tuple[str, ...]], ...] = (
    (before("0.23"), _QUEUE_MEMBERS),
    (since("0.23"), (*_QUEUE_MEMBERS, "prepend_n")),
)

TARGETS = (KV_CACHE_MANAGER, BLOCK_POOL, RESET_PREFIX_CACHE, GET_USAGE, EVICT_BLOCKS, EVICT_CACHED,
           ALL_FREE_BLOCKS, KV_CACHE_BLOCK)


def free_queue_members(version: Version) -> tuple[str, ...]:
    """The free-queue members vLLM uses in ``version``."""
    for versions, members in FREE_QUEUE_MEMBERS:
        if version in versions:
            return members
    raise LookupError(f"no free-queue members are declared for vLLM {version}")
