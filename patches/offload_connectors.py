"""vLLM's own offload connectors beside the page-aware block pool: what kvelastic reads of them.

Nothing of a connector is wrapped. The scheduler side reads which connector the
scheduler made, and, for OffloadingConnector, whether its scheduler side has
transfers in flight: from 0.21 its GPU blocks may be freed while a store still
reads them (the connector flushes the store before vLLM reuses the block, but
knows nothing of pages being unmapped), so groups freed meanwhile are held
(``kvelastic/hooks/connector_fence.py``). SimpleCPUOffloadConnector pins
every GPU block it copies (``BlockPool.touch``) until the copy is reported done,
so the ordinary in-use count already keeps those groups mapped.

Also declared: what SimpleCPUOffloadConnector's lazy mode reads of the GPU free
queue, which kvelastic replaces (``FreeOrder`` serves it). The version matrix
scans each release's ``vllm/v1/simple_kv_offload`` for the members it uses and
requires exactly these.

Version differences handled here: OffloadingConnector's in-flight work is
``_reqs_being_stored`` / ``_reqs_being_loaded`` before 0.21 and ``_jobs`` from
0.21; SimpleCPUOffloadConnector exists from 0.19; its lazy walk starts at
``fake_free_list_head`` and follows ``next_free_block`` up to 0.25, and calls
``iter_blocks_after`` from 0.26.
"""

from __future__ import annotations

from typing import Any

from kvelastic.patching.spec import Absent, Attributes, Target
from kvelastic.patching.versions import Version, VersionRange
from kvelastic.patches._common import ALL, before, since

_OFFLOADING = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
OFFLOADING_CONNECTOR = Target(  # read: its scheduler side
    module=_OFFLOADING,
    qualname="OffloadingConnector",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("connector_scheduler",)),),
)
OFFLOADING_SCHEDULER = Target(  # read: whether transfers are in flight (defined in offloading.scheduler from 0.19)
    module=_OFFLOADING,
    qualname="OffloadingConnectorScheduler",
    kind="class",
    use="read",
    shapes=(Attributes(before("0.21"), ("_reqs_being_stored", "_reqs_being_loaded")),
            Attributes(since("0.21"), ("_jobs",))),
)
SIMPLE_CONNECTOR = Target(  # read: only which connector it is
    module="vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
    qualname="SimpleCPUOffloadConnector",
    kind="class",
    use="read",
    shapes=(Absent(before("0.19")), Attributes(since("0.19"), ("scheduler_manager",))),
)

TARGETS = (OFFLOADING_CONNECTOR, OFFLOADING_SCHEDULER, SIMPLE_CONNECTOR)

#: What SimpleCPUOffloadConnector's lazy mode reads of ``BlockPool.free_block_queue``, per release
#: (besides ``next_free_block`` on the blocks it walks up to 0.25). The version matrix checks each
#: release's source against this, and the tests that the page-aware queue offers all of it.
LAZY_WALK_MEMBERS: tuple[tuple[VersionRange, tuple[str, ...]], ...] = (
    (before("0.19"), ()),
    (VersionRange.of("0.19", "0.26"), ("fake_free_list_head", "fake_free_list_tail")),
    (since("0.26"), ("iter_blocks_after",)),
)


def lazy_walk_members(version: Version) -> tuple[str, ...]:
    """The free-queue members SimpleCPUOffloadConnector's lazy mode uses in ``version``."""
    for versions, members in LAZY_WALK_MEMBERS:
        if version in versions:
            return members
    raise LookupError(f"no lazy-walk members are declared for vLLM {version}")


def is_a(obj: Any, target: Target) -> bool:
    """``obj`` is an instance of the class ``target`` names (or of a subclass of it)."""
    return any(cls.__qualname__ == target.qualname and cls.__module__ == target.module
               for cls in type(obj).__mro__)


def offload_in_flight(patcher: Any, connector_scheduler: Any) -> bool:
    """OffloadingConnector's scheduler side has a load or store that the workers have not reported done.

    Each declared attribute is a dict; before 0.21 a lookup leaves an empty entry behind for every
    request (a ``defaultdict``), so only a non-empty entry counts.
    """
    return any(value for name in patcher.attributes(OFFLOADING_SCHEDULER)
               for value in getattr(connector_scheduler, name).values())
