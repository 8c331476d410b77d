"""What a page group costs in each KV layout of vLLM 0.29+, for real model shapes (CPU, no GPU).

vLLM's own planner (``get_kv_cache_config_from_groups``) places the layers and
vLLM's own ``create_kv_cache_views`` builds the views, over a ``meta`` backing
(no memory). kvelastic then reads the group layout off those views exactly as it
does on the GPU and reports, per layout: blocks per group, pages per group
(what mapping one more group costs, and what the free-memory estimate charges),
and whether neighbouring groups share pages. Rows are printed for the block
count vLLM would plan and for kvelastic's rounded one.

    .venv-band-c/bin/python scripts/band_c_layout_cost.py            # vLLM 0.29+ installed
"""

from __future__ import annotations

import argparse

import torch

from kvelastic.pool.kv_layout import KVGroupLayout, merge_runs, runs_of_view
from kvelastic.worker.page_alignment import aligned_num_blocks, group_blocks_of_config, layer_outermost_multiple
from kvelastic.worker.single_backing import VIEW_BLOCK_DIM

MIB = 1024**2
SHAPES = {  # layers, KV heads (per rank), head size: bf16, 16-token blocks
    "1B (Llama 3.2)": (16, 8, 64),
    "8B (Llama 3.1)": (32, 8, 128),
    "Qwen2.5-7B": (28, 4, 128),
    "70B, TP=4": (80, 2, 128),
}


def plan(layout, layers: int, heads: int, head_size: int, num_blocks: int):
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)
    config = VllmConfig(cache_config=CacheConfig(block_size=16), device_config=DeviceConfig(device="cpu"))
    config.cache_config.kv_cache_layout = layout.name
    config.cache_config.num_gpu_blocks_override = num_blocks
    groups = [KVCacheGroupSpec([f"l{i}" for i in range(layers)], spec)]
    return spec, get_kv_cache_config_from_groups(config, groups, 1 << 50)


def group_layout(layout, spec, config, page_bytes: int) -> KVGroupLayout:
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    (tensor,) = config.kv_cache_tensors
    backing = torch.empty(tensor.size, dtype=torch.int8, device="meta")
    per_view = []
    for view in create_kv_cache_views(backing, spec, config.num_blocks, layout, tensor):
        byte_offset = view.storage_offset() * view.element_size()
        per_view.append((0, *runs_of_view(view.shape, view.stride(), view.element_size(), byte_offset,
                                          config.num_blocks, VIEW_BLOCK_DIM)))
    return KVGroupLayout(merge_runs(per_view), config.num_blocks, page_bytes,
                         group_blocks_of_config(config, page_bytes))


def shared_pages(layout: KVGroupLayout, groups: int = 8) -> int:
    """Pages that two of the first ``groups`` groups both need."""
    seen: dict[int, int] = {}
    shared = set()
    for group in range(min(groups, layout.num_groups)):
        for ref in layout.pages(group):
            if seen.setdefault(ref.page, group) != group:
                shared.add(ref.page)
    return len(shared)


def main() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-mib", type=int, default=8, help="pool page (KVELASTIC_CHUNK_SIZE), MiB")
    parser.add_argument("--blocks", type=int, default=30001, help="blocks vLLM plans before rounding")
    args = parser.parse_args()
    page = args.page_mib * MIB
    print(f"| model | layout | blocks | blocks/group | pages/group (group 1) | pages shared by groups 0-7 |")
    print("|---|---|---:|---:|---:|---:|")
    for model, (layers, heads, head_size) in SHAPES.items():
        for layout in (KVCacheLayout.BLNHC, KVCacheLayout.LBNHC, KVCacheLayout.LBHNC):
            spec, config = plan(layout, layers, heads, head_size, args.blocks)
            counts = [args.blocks]
            multiple = layer_outermost_multiple(config, page)
            if multiple is not None and aligned_num_blocks(args.blocks, multiple) != args.blocks:
                counts.append(aligned_num_blocks(args.blocks, multiple))
            for blocks in counts:
                spec, config = plan(layout, layers, heads, head_size, blocks)
                groups = group_layout(layout, spec, config, page)
                print(f"| {model} | {layout.name} | {blocks} | {groups.blocks_per_group} | "
                      f"{len(groups.pages(1))} | {shared_pages(groups)} |")


if __name__ == "__main__":
    main()
