"""vLLM 0.29+: what the offload connectors' workers derive from the one KV backing, against kvelastic's groups.

Band C's counterpart of ``test_connector_worker_layout.py``. The connectors' own
worker sides (SimpleCPUOffloadConnector and OffloadingConnector of the installed
release, created with the worker role as vLLM creates them) register the views
that vLLM's ``allocate_kv_cache`` built over kvelastic's pool backing (through the
runner's patched name), published in whole-page groups as on the GPU. Only what
needs CUDA is stood in for, at the point where each worker hands over what it
derived: SimpleCPUOffload's copy streams and its pinned-buffer set-up (which
receives the ``[num_blocks, block_bytes]`` regions it copies from), and
OffloadingConnector's transfer handlers (which receive its block-strided
tensors). The property: row ``b`` of every such tensor, the bytes a store or
load of block ``b`` copies, lies in the pages of block ``b``'s group, so a copy
never touches a page that the group does not hold; and the rows together cover
every layer's bytes of block ``b``, so the connector copies the whole block.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.29+ installed (band C)")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvelastic.worker.allocation import publish_views  # noqa: E402
from kvelastic.worker.page_alignment import group_blocks_of_config, layer_outermost_multiple  # noqa: E402
from kvelastic.worker.single_backing import VIEW_BLOCK_DIM  # noqa: E402
from tests.connector_harness import connector_config  # noqa: E402
from tests.kv_fixtures import BS, D, H, N  # noqa: E402
from tests.test_single_backing import BandC, plan  # noqa: E402

PAGE = 16 * 1024
#: the block-outermost layout kvelastic prefers, FlashAttention's default, the OffloadingConnector's
LAYOUTS = [KVCacheLayout.BLNHC, KVCacheLayout.LBNHC, KVCacheLayout.LBHNC]


class NoCopyStream:
    """``torch.cuda.Stream`` for a worker that will never copy here: there is no GPU."""

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, 0

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority


def cache_groups(two: bool) -> list:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["l0", "l1", "l2"], full)]
    if two:  # a sliding-window group overlays the same backing from byte 0
        sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16,
                                    sliding_window=4 * BS)
        groups.append(KVCacheGroupSpec(["s0", "s1", "s2"], sliding))
    return groups


def derived_by_simple_offload(config, views: dict, monkeypatch) -> list[torch.Tensor]:
    """The regions SimpleCPUOffloadConnector's worker derives and would copy blocks from and to."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        SimpleCPUOffloadConnector,
    )
    from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

    handed: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "Stream", NoCopyStream)
    monkeypatch.setattr(SimpleCPUOffloadWorker, "_init_cpu_mode",
                        lambda worker, regions, bytes_per_block, device: handed.extend(regions.values()))
    SimpleCPUOffloadConnector(connector_config("simple-eager"), KVConnectorRole.WORKER, config) \
        .register_kv_caches(views)
    return handed


def derived_by_offloading_connector(config, views: dict, monkeypatch) -> list[torch.Tensor]:
    """The block-strided tensors OffloadingConnector's worker hands its CPU-GPU transfer handlers."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    handed: list[torch.Tensor] = []
    monkeypatch.setattr(CPUOffloadingSpec, "get_worker",
                        lambda spec, kv_caches: handed.extend(t.tensor for t in kv_caches.tensors))
    OffloadingConnector(connector_config("offload-lru"), KVConnectorRole.WORKER, config).register_kv_caches(views)
    return handed


def element_offsets(view: torch.Tensor, region) -> torch.Tensor:
    """Row ``b``: the region offsets of the elements of manager block ``b`` in one layer's view."""
    size = view.element_size()
    index = torch.as_strided(torch.arange(view.untyped_storage().nbytes() // size), view.shape, view.stride(),
                             view.storage_offset())
    return index.reshape(N, -1) * size + (view.untyped_storage().data_ptr() - region.address)


@pytest.mark.parametrize("two_groups", [False, True], ids=["one-group", "full-and-sliding"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("derive", [derived_by_simple_offload, derived_by_offloading_connector],
                         ids=["SimpleCPUOffload", "OffloadingConnector"])
def test_every_block_a_connector_copies_lies_in_its_groups_pages(derive, layout, two_groups, monkeypatch):
    config = plan(layout, cache_groups(two_groups), N)
    multiple = layer_outermost_multiple(config, PAGE)
    assert multiple is None or N % multiple == 0  # what the engine core's rounding gives: layers start on pages
    env = BandC(PAGE)
    try:
        views = env.allocate(config, layout, None)
        pool = env.runtime.finish_allocation()
        cache = publish_views(env.runtime, pool, views.values(), N, premap_blocks=1,
                              blocks_per_group=group_blocks_of_config(config, PAGE), block_dim=VIEW_BLOCK_DIM)
        rows = derive(config, views, monkeypatch)
        assert rows, "the connector registered nothing to copy"
        region = pool.region_of(next(iter(views.values())))
        layers = {name: (element_offsets(view, region), view.element_size()) for name, view in views.items()}
        for block in range(N):
            group_pages = {ref.page for ref in cache.layout.pages(cache.group_of_block(block))
                           if ref.region == region.region_id}
            copied = []
            for tensor in rows:
                assert pool.region_of(tensor) is region  # every copy is over the one backing
                low = tensor[block].data_ptr() - region.address
                high = low + tensor.shape[1] * tensor.element_size()
                copied.append((low, high))
                touched = set(range(low // PAGE, (high - 1) // PAGE + 1))
                assert touched <= group_pages, f"block {block}'s copy reaches pages its group does not map"
            for name, (offsets, size) in layers.items():
                inside = torch.zeros(offsets.shape[1], dtype=torch.bool)
                for low, high in copied:
                    inside |= (offsets[block] >= low) & (offsets[block] + size <= high)
                assert inside.all(), f"block {block} of {name}: {int((~inside).sum())} elements never copied"
    finally:
        env.close()
