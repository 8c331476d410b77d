"""A small host-backed KV cache shaped like vLLM's FlashAttention layout, shared by the tests.

Three layers of (2, N, 16, 2, 32) bf16 views: each block has a K half and a V
half of 2 KiB per layer; 64 KiB pages hold 32 blocks, so a group is 6 pages.
The worker ranks of the TP tests, each a process with such a cache, are
``tests/tp_ranks.py``'s; the scheduler side in front of them is ``tests/tp_cluster.py``'s.
"""

from __future__ import annotations

import time
import types

import torch

from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.pool.kv_layout import KVGroupLayout, merge_runs, runs_of_view
from kvelastic.pool import HostBackend, PagePool
from kvelastic.pool.sources import DeviceSource, LimitedSource, ReserveSource
from kvelastic.pool.stats import StatisticsSource

N, BS, H, D, LAYERS = 256, 16, 2, 32, 3
HALF = BS * H * D * 2              # bytes of a block's K (or V) half in one layer
PAGE = 32 * HALF                   # 64 KiB pages: 32 blocks per group
BLOCKS_PER_GROUP = 32
GROUP_PAGES = 2 * LAYERS           # K and V page of every layer
GROUP_BYTES = GROUP_PAGES * PAGE


class Clock:
    """The real monotonic clock plus an offset a test moves (a queue's own stamps stay real)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class Engine(types.SimpleNamespace):
    """A test's pieces of one engine; never printed whole (a failure report would read KV views over
    unmapped pages)."""

    def __repr__(self) -> str:
        return "<Engine>"


class StandInRequest:
    """The one attribute ``BlockPool.cache_full_blocks`` reads from a request."""

    def __init__(self, hashes: list[bytes]):
        self.block_hashes = hashes


class NamedHostBackend(HostBackend):
    """Host memory that goes by another device name: a rank "on another GPU" names another account."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name


def build_cache(limit_groups: int | None = None, backend: HostBackend | None = None, wrap_device=None,
                layers: int = LAYERS, num_blocks: int = N, page_bytes: int = PAGE):
    """(pool, per-layer views, elastic cache) over the host backend (or ``backend``, a variant of it).

    ``wrap_device(source)`` inserts a layer above the device in the usual stack (the shared account's gate).
    ``layers``: how many KV layers this cache holds (a pipeline stage holds only its own).
    ``num_blocks``, ``page_bytes``: a larger cache, or larger groups (``page_bytes // HALF`` blocks each),
    shaped like a GPU engine's.
    """
    if wrap_device is None:
        pool = PagePool.standard(backend or HostBackend(), page_bytes=page_bytes)
    else:
        backend = backend or HostBackend()
        device = wrap_device(StatisticsSource(DeviceSource(backend, page_bytes)))
        pool = PagePool(backend, ReserveSource(LimitedSource(device)))
    raws = [pool.add_tensor(2 * num_blocks * HALF) for _ in range(layers)]
    views = [raw.view(torch.bfloat16).view(2, num_blocks, BS, H, D) for raw in raws]
    per_view = []
    for raw, view in zip(raws, views):
        region = pool.region_of(raw)
        per_view.append((region.region_id, *runs_of_view(view.shape, view.stride(), 2,
                                                          view.data_ptr() - region.address, num_blocks)))
    layout = KVGroupLayout(merge_runs(per_view), num_blocks, page_bytes)
    if limit_groups is not None:
        pool.set_limit(limit_groups * 2 * layers * page_bytes)
    return pool, views, ElasticKVCache(pool, layout)


def kv_cache_tensors(layers: list[str], num_blocks: int, page_bytes: int) -> list:
    """vLLM's ``KVCacheTensor`` entries for one group of ``layers``, in the installed release's declared shape.

    Up to 0.28 an entry per layer (``shared_by``); from 0.29 one backing that places the
    layers one after another (layer-outermost, as vLLM's planner lays out ``LBNHC``).
    """
    from vllm.v1.kv_cache_interface import KVCacheTensor

    from kvelastic.patches.kv_cache_objects import KV_CACHE_TENSOR
    from kvelastic.patching.versions import installed_vllm_version

    if "shared_by" in KV_CACHE_TENSOR.shape(installed_vllm_version()).names:
        return [KVCacheTensor(size=num_blocks * page_bytes, shared_by=[layer]) for layer in layers]
    return [KVCacheTensor(size=len(layers) * num_blocks * page_bytes, layers=list(layers),
                          layer_stride=num_blocks * page_bytes, block_stride=page_bytes)]


# ------------------------------------------------------------------ the shape of the TP tests' ranks
WORLD = 2
#: Each rank's KV layers: tensor-parallel ranks hold the same ones; pipeline stages their own, so
#: their groups differ in bytes but not in blocks (the first stage the smaller: the scheduler must
#: not take its sizes for all).
RANK_LAYERS = {"tensor": (3, 3), "pipeline": (1, 2)}


def group_bytes(layers: int) -> int:
    """A group's bytes on a rank holding ``layers`` layers (a K and a V page each)."""
    return 2 * layers * PAGE
