"""KV connectors the elastic pool cannot serve, refused before the KV cache is allocated.

kvelastic maps a page group's physical memory only while its blocks are used,
and later maps other physical pages at the same addresses. Two kinds of KV
connector cannot follow that, so the KV cache's initialisation stops with a
message naming the connector, before vLLM allocates anything or the connector
registers it:

- A connector that **reaches the KV cache from outside this process**: one that
  registers the memory with UCX or RDMA (NIXL between GPUs, Mooncake, MoRI-IO,
  UMBP) or hands it to another process (LMCache's multi-process connector, by
  CUDA IPC). Registration takes hold of the physical pages mapped at that moment:
  pages mapped later are out of its reach and pages unmapped under it fault or
  are read stale. From 0.34 vLLM declares how each connector reaches the KV cache
  (``KVTransferConfig.kv_cache_access()``, the flags its own extensible cache
  decides on); before 0.34, :data:`OUTSIDE_ACCESS` names vLLM's connectors that
  0.34 declares so.
- A connector that **allocates the KV cache in a memory pool of its own**
  (``get_mem_pool_context``, 0.31+, Mooncake's NVLink pool): the pool would never
  hold kvelastic's pages.

Connectors that copy the KV cache inside this process (vLLM's offload connectors,
LMCache's in-process ``LMCacheConnectorV1``, P2P NCCL, ...) are not refused: the
blocks they keep in use fence their copies (``kvelastic/hooks/connector_fence.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from kvelastic.errors import ConnectorUnsupported

_NIXL = "registers it with UCX for RDMA, and NIXL peers on this host map it through CUDA IPC"
_REGISTERS = "registers it with {} for RDMA"

#: vLLM's own connectors that reach the KV cache from outside the process, as vLLM 0.34 declares them
#: (``kv_cache_access``): what each does with it. Read by releases before 0.34, which declare nothing.
OUTSIDE_ACCESS: dict[str, str] = {
    "NixlConnector": _NIXL,
    "NixlPullConnector": _NIXL,
    "NixlPushConnector": _NIXL,
    "MooncakeConnector": _REGISTERS.format("Mooncake's transfer engine"),
    "MooncakeStoreConnector": _REGISTERS.format("Mooncake's transfer engine"),
    "MoRIIOConnector": _REGISTERS.format("MoRI-IO"),
    "UMBPStoreConnector": _REGISTERS.format("UMBP"),
    "LMCacheMPConnector": "shares it with the LMCache server process through CUDA IPC",
}
#: NIXL with ``kv_buffer_device="cpu"`` registers host staging buffers and copies the KV cache in process.
_HOST_STAGED = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})


def _children(config: Any) -> Iterable[tuple[str | None, str]]:
    """(connector name, kv_buffer_device) of ``config`` and, for MultiConnector, of each child it lists."""
    if config.kv_connector != "MultiConnector":
        yield config.kv_connector, config.kv_buffer_device
        return
    for child in config.kv_connector_extra_config.get("connectors", []):
        yield child.get("kv_connector"), child.get("kv_buffer_device", config.kv_buffer_device)


def listed_outside_access(config: Any) -> str | None:
    """Before 0.34: how the configured connector reaches the KV cache from outside the process, from
    :data:`OUTSIDE_ACCESS`; None where it (and, in MultiConnector, every child) copies it in process."""
    for name, buffer_device in _children(config):
        how = OUTSIDE_ACCESS.get(name or "")
        if how is not None and not (name in _HOST_STAGED and buffer_device == "cpu"):
            return f"{name} {how}"
    return None


def declared_outside_access(config: Any) -> str | None:
    """0.34+: the same from vLLM's own declaration, ``KVTransferConfig.kv_cache_access()``."""
    access = config.kv_cache_access()
    if not access:  # KVCacheAccess.IN_PROCESS
        return None
    return f"{config.kv_connector} reaches it from outside this process (vLLM declares its access {access.name})"


def refuse_outside_access(config: Any, outside_access: Callable[[Any], str | None]) -> None:
    """Stop before the KV cache is allocated when the configured connector (``config``: vLLM's
    ``KVTransferConfig`` or None) reaches it from outside this process."""
    how = None if config is None or config.kv_connector is None else outside_access(config)
    if how is None:
        return
    cpu_hint = (' (NIXL with kv_buffer_device "cpu" stages the KV cache in host buffers and can run)'
                if any(name in _HOST_STAGED for name, _ in _children(config)) else "")
    raise ConnectorUnsupported(
        f"kvelastic: the KV connector {how}; kvelastic maps and unmaps the KV cache's pages while serving, "
        f"which memory registered or shared once cannot follow. Run this connector with KVELASTIC=0{cpu_hint}")


def refuse_connector_pool(connector_has_pool: bool) -> None:
    """A KV connector that allocates the KV cache in its own pool (0.31+) would never get kvelastic's pages."""
    if connector_has_pool:
        raise ConnectorUnsupported(
            "kvelastic: this KV connector allocates the KV cache in a memory pool of its own "
            "(get_mem_pool_context, such as Mooncake's), but kvelastic serves the KV cache from its page pool, "
            "so the connector would not hold it. Run this connector with KVELASTIC=0")
