"""How the configured KV connector reaches the KV cache, read to refuse one that does so from outside the process.

Nothing is wrapped. Read off ``VllmConfig.kv_transfer_config`` in the worker,
before the KV cache is allocated (``kvelastic/worker/connector_access.py``):
the connector's name, its buffer device and, for MultiConnector, its children.
From 0.34 vLLM declares each connector's access itself
(``KVTransferConfig.kv_cache_access()``, whose flags decide whether vLLM's own
extensible KV cache can serve the connector); kvelastic asks it there and reads
its own list of vLLM's connectors before.

Version difference handled here: ``kv_cache_access`` exists from 0.34
(:func:`outside_access_test`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from kvelastic.patching.spec import Absent, Attributes, Signature, Target
from kvelastic.patches._common import ALL, BAND_D, before

if TYPE_CHECKING:
    from kvelastic.patching.apply import Patcher

KV_TRANSFER_CONFIG = Target(
    module="vllm.config",
    qualname="KVTransferConfig",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("kv_connector", "kv_buffer_device", "kv_connector_extra_config")),),
)
KV_CACHE_ACCESS = Target(
    module="vllm.config",
    qualname="KVTransferConfig.kv_cache_access",
    kind="method",
    use="read",
    shapes=(Absent(before("0.34")), Signature(BAND_D, ("self",))),
)

TARGETS = (KV_TRANSFER_CONFIG, KV_CACHE_ACCESS)


def outside_access_test(patcher: Patcher) -> Callable[[Any], str | None]:
    """How a ``KVTransferConfig``'s connector reaches the KV cache from outside the process (None: it does
    not), asked the way the patched release can answer."""
    from kvelastic.worker.connector_access import declared_outside_access, listed_outside_access

    return declared_outside_access if patcher.declares(KV_CACHE_ACCESS) else listed_outside_access
