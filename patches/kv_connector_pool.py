"""vLLM 0.31+: a KV connector that brings its own memory pool for the KV cache, read to refuse it.

From 0.31 ``Worker.initialize_from_config`` asks the KV connector for
``get_mem_pool_context()`` and, where it returns one (Mooncake's NVLink/BAREX
pool), allocates the KV cache inside it so that the connector can register or
share that memory. kvelastic serves the one KV backing from its own page pool
instead, so the connector's pool would never hold the KV cache: the single-
backing patches ask the connector the same question before anything is
allocated and refuse (``kvelastic/worker/single_backing.py``).

Version difference handled here: the method exists from 0.31
(:func:`connector_pool_test`); before that no connector can ask for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from kvelastic.patching.spec import Absent, Signature, Target
from kvelastic.patching.versions import VersionRange
from kvelastic.patches._common import FROM_BAND_C, since

if TYPE_CHECKING:
    from kvelastic.patching.apply import Patcher

_STATE = "vllm.distributed.kv_transfer.kv_transfer_state"
HAS_CONNECTOR = Target(module=_STATE, qualname="has_kv_transfer_group", kind="function", use="read",
                       shapes=(Signature(FROM_BAND_C, ()),))
CONNECTOR = Target(module=_STATE, qualname="get_kv_transfer_group", kind="function", use="read",
                   shapes=(Signature(FROM_BAND_C, ()),))
MEM_POOL_CONTEXT = Target(
    module="vllm.distributed.kv_transfer.kv_connector.v1.base",
    qualname="KVConnectorBase_V1.get_mem_pool_context",
    kind="method",
    use="read",
    shapes=(Absent(VersionRange.of("0.29", "0.31")), Signature(since("0.31"), ("self",))),
)

TARGETS = (HAS_CONNECTOR, CONNECTOR, MEM_POOL_CONTEXT)


def connector_pool_test(patcher: Patcher) -> Callable[[], bool]:
    """Whether this process's KV connector allocates the KV cache in a pool of its own, in the patched release."""
    if patcher.declares(MEM_POOL_CONTEXT):
        return _connector_has_pool
    return _no_connector_pool


def _connector_has_pool() -> bool:
    from vllm.distributed.kv_transfer import kv_transfer_state

    return kv_transfer_state.has_kv_transfer_group() and \
        kv_transfer_state.get_kv_transfer_group().get_mem_pool_context() is not None


def _no_connector_pool() -> bool:
    return False
