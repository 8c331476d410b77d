"""Which bytes of a raw KV tensor a vLLM block occupies, read off the views vLLM built.

vLLM allocates one flat int8 tensor per layer and reshapes it per attention
backend: (2, num_blocks, ...) for FlashAttention, (num_blocks, 2, ...) for
FlashInfer, strided views for packed or hybrid layouts. Rather than know every
backend, we look at the final views: the dimension of length num_blocks (times
the kernel split) and its stride give the block stride; the dimensions with a
larger stride give the separate runs a block is split into (K and V halves).
The result is a :class:`KVGroupLayout` that tells the pool which pages a group
of blocks needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Iterable, Sequence

from kvelastic.errors import LayoutError
from kvelastic.pool.layout import GroupLayout, PageRef


@dataclass(frozen=True)
class BlockRuns:
    """In one region, block b occupies ``[start + b*block_stride, +length)`` for each run."""

    region: int
    block_stride: int
    runs: tuple[tuple[int, int], ...]


def runs_of_view(shape: Sequence[int], stride: Sequence[int], element_size: int,
                 byte_offset: int, num_blocks: int,
                 block_dim: int | None = None) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Block stride and byte runs of one view whose block dimension has ``num_blocks * m`` entries.

    ``block_dim`` names that dimension where the caller knows it (vLLM 0.29+ views
    are ``[B, H, N, C]``); otherwise it is the one dimension whose length fits.
    """
    candidates = [d for d, n in enumerate(shape) if n >= num_blocks and n % num_blocks == 0]
    exact = [d for d in candidates if shape[d] == num_blocks]
    if block_dim is not None:
        candidates = [block_dim] if block_dim in candidates else []
    elif len(exact) == 1:
        candidates = exact  # a kernel block split only applies when no dimension matches exactly
    if len(candidates) != 1:
        raise LayoutError(f"cannot tell the block dimension of a KV view of shape {tuple(shape)} "
                          f"for {num_blocks} blocks (candidates: {candidates})")
    dim = candidates[0]
    split = shape[dim] // num_blocks
    block_stride = stride[dim] * split * element_size
    outer = [d for d in range(len(shape)) if d != dim and stride[d] > stride[dim]]
    inner = [d for d in range(len(shape)) if d != dim and stride[d] <= stride[dim]]
    inner_extent = 1 + sum((shape[d] - 1) * stride[d] for d in inner if shape[d] > 0)
    length = ((split - 1) * stride[dim] + inner_extent) * element_size
    if length > block_stride and outer:
        raise LayoutError(f"blocks of a KV view of shape {tuple(shape)} overlap each other")
    starts = []
    for index in product(*(range(shape[d]) for d in outer)):
        starts.append(byte_offset + sum(i * stride[d] * element_size for i, d in zip(index, outer)))
    return block_stride, tuple((start, length) for start in sorted(starts))


def merge_runs(per_view: Iterable[tuple[int, int, tuple[tuple[int, int], ...]]]) -> list[BlockRuns]:
    """Combine the views of each region that share a block stride: one :class:`BlockRuns` per (region, stride).

    A region usually has one stride. vLLM 0.29+ puts every layer in one backing, and
    under a layer-outermost layout layers of different page sizes (one group of
    ``UniformTypeKVCacheSpecs``) step through it with different strides: each
    stride's layers then get runs of their own in the same region.
    """
    runs: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for region, block_stride, view_runs in per_view:
        runs.setdefault((region, block_stride), set()).update(view_runs)
    return [BlockRuns(region, stride, _coalesce(sorted(runs[region, stride]))) for region, stride in sorted(runs)]


def _coalesce(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[list[int]] = []
    for start, length in runs:
        if merged and start <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + length - merged[-1][0])
        else:
            merged.append([start, length])
    return tuple((s, n) for s, n in merged)


class KVGroupLayout(GroupLayout):
    """Group g is blocks ``[g*k, (g+1)*k)``; its pages are those those blocks touch."""

    def __init__(self, regions: Sequence[BlockRuns], num_blocks: int, page_bytes: int,
                 blocks_per_group: int | None = None):
        if not regions:
            raise LayoutError("no KV tensor to lay out")
        self.regions = list(regions)
        self.num_blocks = num_blocks
        self.page_bytes = page_bytes
        smallest = min(r.block_stride for r in self.regions)
        self.blocks_per_group = blocks_per_group or max(1, page_bytes // smallest)
        self._cache: dict[int, list[PageRef]] = {}

    @property
    def num_groups(self) -> int:
        return -(-self.num_blocks // self.blocks_per_group)

    def group_of_block(self, block_id: int) -> int:
        return block_id // self.blocks_per_group

    def blocks_of_group(self, group: int) -> range:
        first = group * self.blocks_per_group
        return range(first, min(first + self.blocks_per_group, self.num_blocks))

    def pages(self, group: int) -> Sequence[PageRef]:
        cached = self._cache.get(group)
        if cached is not None:
            return cached
        blocks = self.blocks_of_group(group)
        if not blocks:
            raise IndexError(f"group {group} outside 0..{self.num_groups - 1}")
        seen: dict[int, set[int]] = {}  # by region: several strides of one region may touch one page
        for region in self.regions:
            touched = seen.setdefault(region.region, set())
            for start, length in region.runs:
                low = start + blocks.start * region.block_stride
                high = start + (blocks.stop - 1) * region.block_stride + length
                touched.update(range(low // self.page_bytes, (high - 1) // self.page_bytes + 1))
        pages = [PageRef(region, p) for region, touched in seen.items() for p in sorted(touched)]
        if len(self._cache) < 65536:
            self._cache[group] = pages
        return pages

    def bytes_per_group(self) -> int:
        """Upper bound on the physical bytes one more group costs."""
        return max((len(self.pages(g)) for g in range(min(self.num_groups, 2))), default=0) * self.page_bytes
