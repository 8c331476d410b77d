"""The prefix-cache map, where the host tier answers GPU misses (``hooks/offload_setup.py``).

``BlockPool.cached_block_hash_to_block`` (a ``BlockHashToBlockMap``) gets its
``get_one_block`` wrapped on the instance: a miss the host tier can serve
becomes a hit on a free GPU block that is given the hash, entered in the map
and filled from the host before the next forward pass.

With write-through, ``BlockPool.cache_full_blocks`` is wrapped on the GPU
pool's instance too: the blocks it names are stored to the host once computed.
It takes ``block_mask`` from 0.22; the wrapper reads only ``blocks`` and the two
counts, and keeps the blocks that came out with a hash.

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

_CACHE_FULL = ("self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id")
CACHE_FULL_BLOCKS = Target(  # wrapped on the GPU block pool instance: write-through learns which blocks are named full
    module="vllm.v1.core.block_pool",
    qualname="BlockPool.cache_full_blocks",
    kind="method",
    use="instance",
    shapes=(Signature(before("0.22"), _CACHE_FULL), Signature(since("0.22"), (*_CACHE_FULL, "block_mask"))),
)

TARGETS = (GET_ONE_BLOCK, INSERT, HASH_SETTER, SET_BLOCK_HASH, CACHE_FULL_BLOCKS)


def named_full(args: tuple, kwargs: dict) -> list[Any]:
    """The blocks a ``cache_full_blocks`` call (already run) gave a hash: the new full ones, null and masked
    ones left out. Read by position or name as declared (vLLM passes names; it runs once per request and
    step, so no signature binding)."""
    blocks, start, end = (kwargs[name] if name in kwargs else args[i]
                          for i, name in enumerate(_CACHE_FULL[2:5], start=1))
    return [b for b in blocks[start:end] if b.block_hash is not None and not b.is_null]


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
