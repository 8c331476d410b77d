"""What SimpleCPUOffloadConnector's worker assumes of the GPU KV tensors, against kvelastic's allocation.

Its worker (0.19-0.28) needs CUDA for its copies, so on the CPU the
assumptions are checked instead, on tensors made by kvelastic's real allocation
(``allocate_kv_tensors``, host-backed) and shaped as vLLM's FlashAttention
backend shapes them: layers found by de-duplicating tensors by storage, each
storage's ``nbytes()`` equal to ``num_blocks * page``, the storage starting
where the tensor starts, and block ``b``'s row of the flat per-segment views
the worker derives (K and V are outer segments) lying in the pages kvelastic
maps for block ``b``'s group, so a copy never reads or writes a page that the
block's group does not hold.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface", reason="needs vllm installed")

from kvelastic.patches import v1_allocate_kv_cache  # noqa: E402
from kvelastic.patching.versions import installed_vllm_version  # noqa: E402

if not v1_allocate_kv_cache.PATCH.claims(installed_vllm_version()):
    pytest.skip("vLLM 0.29+ allocates one backing (band C), not per-layer tensors: "
                "tests/test_connector_worker_layout_band_c.py runs the connectors' own workers over it",
                allow_module_level=True)

import torch  # noqa: E402

from kvelastic.worker.allocation import allocate_kv_tensors, publish_views  # noqa: E402
from kvelastic.startup.runtime import Runtime  # noqa: E402
from kvelastic.pool import HostBackend  # noqa: E402
from kvelastic.pool.layout import PageRef  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from tests.connector_harness import kv_spec  # noqa: E402
from tests.kv_fixtures import BS, D, H, N  # noqa: E402

CHUNK = 2 << 20


def worker_rows(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(storage's first element as int8, (num_blocks, bytes) view) per segment, as the connector's worker
    derives them: one per storage, split along a dimension whose byte stride exceeds one block's bytes."""
    unique = {}
    for tensor in kv_caches.values():
        unique.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    rows = []
    for tensor in unique.values():
        storage = tensor.untyped_storage()
        flat = torch.empty(0, dtype=torch.int8).set_(storage, 0, (storage.nbytes(),))
        block_bytes = storage.nbytes() // num_blocks
        outer = [d for d in range(tensor.ndim) if tensor.stride(d) * tensor.element_size() > block_bytes]
        if not outer:
            rows.append((flat, flat.view(num_blocks, -1)))
            continue
        segment = tensor.stride(outer[0]) * tensor.element_size()
        for index in range(tensor.shape[outer[0]]):
            rows.append((flat, flat[index * segment:(index + 1) * segment].view(num_blocks, -1)))
    return rows


@pytest.mark.parametrize("shared", [False, True], ids=["per-layer", "two-layers-share-one-tensor"])
def test_simple_offload_workers_assumptions_hold_on_kvelastics_tensors(shared: bool) -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    page = kv_spec().page_size_bytes
    groups = [["l0", "l1"], ["l2"]] if shared else [["l0"], ["l1"], ["l2"]]
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[KVCacheTensor(size=N * page, shared_by=g) for g in groups],
                           kv_cache_groups=[KVCacheGroupSpec(["l0", "l1", "l2"], kv_spec())])
    runtime = Runtime(Settings(enabled=True, chunk_bytes=CHUNK), backend_factory=HostBackend)
    raw = allocate_kv_tensors(runtime, config, packed=False)
    kv_caches = {name: t.view(torch.bfloat16).view(2, N, BS, H, D) for name, t in raw.items()}
    pool = runtime.finish_allocation()
    cache = publish_views(runtime, pool, kv_caches.values(), N)
    try:
        storages = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
        assert len(storages) == len(groups)  # de-duplicated by storage: one per KVCacheTensor
        for tensor in kv_caches.values():
            assert tensor.untyped_storage().nbytes() == N * page
            assert tensor.untyped_storage().data_ptr() == tensor.data_ptr()
        rows = worker_rows(kv_caches, N)
        assert len(rows) == 2 * len(groups)  # a K and a V segment per storage
        assert sum(view.stride(0) for _, view in rows) == len(groups) * page  # what one CPU block holds
        for flat, view in rows:
            region = pool.region_of(flat)
            for block in range(N):
                low = view[block].data_ptr() - region.address
                high = low + view.shape[1]
                touched = {PageRef(region.region_id, p)
                           for p in range(low // cache.layout.page_bytes, (high - 1) // cache.layout.page_bytes + 1)}
                assert touched <= set(cache.layout.pages(cache.group_of_block(block))), \
                    f"block {block}'s row reaches pages its group does not map"
    finally:
        del kv_caches, raw
        pool.close()
