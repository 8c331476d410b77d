"""The prefix-cache map, where the host tier answers GPU misses (``hooks/offload_setup.py``).

``BlockPool.cached_block_hash_to_block`` (a ``BlockHashToBlockMap``) gets its
``get_one_block`` wrapped on the instance: a miss the host tier can serve
becomes a hit on a free GPU block that is given the hash, entered in the map
and filled from the host before the next forward pass.

Version difference handled here: how a block is given its hash. Up to 0.23
``KVCacheBlock.block_hash`` is a property with a setter; from 0.24 it is
read-only and ``set_block_hash(block_hash, num_tokens)`` sets it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable

from kvelastic.patching.spec import Absent, Signature, Target
from kvelastic.patches._common import ALL, before, since

if TYPE_CHECKING:
    from kvelastic.patching.apply import Patcher

GET_ONE_BLOCK = Target(  # wrapped on the block pool's map instance (again after a reset replaces the map)
    module="vllm.v1.core.block_pool",
    qualname="BlockHashToBlockMap.get_one_block",
    kind="method",
    use="instance",
    shapes=(Signature(ALL, ("self", "key")),),
)
INSERT = Target(  # read: a block loaded from the host is entered in the map
    module="vllm.v1.core.block_pool",
    qualname="BlockHashToBlockMap.insert",
    kind="method",
    use="read",
    shapes=(Signature(ALL, ("self", "key", "block")),),
)
HASH_SETTER = Target(
    module="vllm.v1.core.kv_cache_utils",
    qualname="KVCacheBlock.block_hash",
    kind="setter",
    use="read",
    shapes=(Signature(before("0.24"), ("self", "block_hash")), Absent(since("0.24"))),
)
SET_BLOCK_HASH = Target(
    module="vllm.v1.core.kv_cache_utils",
    qualname="KVCacheBlock.set_block_hash",
    kind="method",
    use="read",
    shapes=(Absent(before("0.24")), Signature(since("0.24"), ("self", "block_hash", "num_tokens"))),
)

TARGETS = (GET_ONE_BLOCK, INSERT, HASH_SETTER, SET_BLOCK_HASH)


def hash_assigner(patcher: Patcher) -> Callable[[Any, Hashable], None]:
    """How to give a free block the hash of the data about to be loaded into it, in the patched release."""
    if patcher.declares(SET_BLOCK_HASH):
        return _assign_through_method
    if patcher.declares(HASH_SETTER):
        return _assign_through_setter
    raise LookupError(f"no way to set a block's hash is declared for vLLM {patcher.version}")


def _assign_through_method(block: Any, key: Hashable) -> None:
    block.set_block_hash(key)


def _assign_through_setter(block: Any, key: Hashable) -> None:
    block.block_hash = key
