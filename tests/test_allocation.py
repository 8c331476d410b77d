"""vLLM's own (patched) KV allocation over a host-backed page pool, and publishing its layout (0.12-0.28).

kvelastic is activated in this process with the host backend, then vLLM's real
``_allocate_kv_cache`` (V2 runner) and ``GPUModelRunner._allocate_kv_cache_tensors``
(V1 runner) are called with real ``KVCacheConfig`` objects.
"""

from __future__ import annotations

import dataclasses

import gc
import logging
import sys
import types

import pytest
import torch

pytest.importorskip("vllm", reason="needs vllm installed")

from kvelastic.patches import v1_allocate_kv_cache  # noqa: E402
from kvelastic.patching.versions import installed_vllm_version  # noqa: E402

if not v1_allocate_kv_cache.PATCH.claims(installed_vllm_version()):
    pytest.skip("vLLM 0.29+ allocates one backing (band C): tests/test_single_backing.py covers it",
                allow_module_level=True)

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from kvelastic.errors import ConfigError, PoolClosedError  # noqa: E402
from kvelastic.startup import activate as activation  # noqa: E402
from kvelastic.worker.allocation import publish_views, startup_blocks  # noqa: E402
from kvelastic.startup.runtime import Runtime  # noqa: E402
from kvelastic.pool import HostBackend  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from kvelastic.units import align_up  # noqa: E402

MIB, GIB = 1024**2, 1024**3
CHUNK = 2 * MIB
N = 1024                      # blocks
BS, HEADS, HEAD = 16, 8, 64   # block size, KV heads, head size (bf16)
SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
BLOCK_BYTES = 2 * BS * HEADS * HEAD * 2          # K and V of one block: 32 KiB
HALF_BLOCK = BLOCK_BYTES // 2                    # the K (or V) half: 16 KiB
SIZE = N * BLOCK_BYTES                           # 32 MiB per KV tensor
BLOCKS_PER_GROUP = CHUNK // HALF_BLOCK           # 128
GROUPS = N // BLOCKS_PER_GROUP                   # 8


def config(tensors=None, layers=("l0", "l1", "l2"), num_blocks=N) -> KVCacheConfig:
    tensors = tensors or [KVCacheTensor(size=num_blocks * BLOCK_BYTES, shared_by=["l0"]),
                          KVCacheTensor(size=num_blocks * BLOCK_BYTES, shared_by=["l1", "l2"])]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(list(layers), SPEC)])


def flash_view(raw: torch.Tensor, num_blocks: int = N) -> torch.Tensor:
    """What vLLM's FlashAttention backend makes of a raw KV tensor: (2, blocks, 16, heads, head)."""
    return raw.view(torch.bfloat16).view(2, num_blocks, BS, HEADS, HEAD)


@pytest.fixture
def runtime():
    activation.deactivate()
    active = activation.activate(Settings(enabled=True, chunk_bytes=CHUNK), backend_factory=HostBackend)
    assert active is not None
    yield active.runtime
    pools = [engine_pool.pool for engine_pool in active.runtime._pools]
    activation.deactivate()
    active.runtime.cache = None
    for pool in pools:
        pool.close()
        assert pool.leak_report() == []


def v2_allocate(cfg):
    from vllm.v1.worker.gpu import attn_utils

    return attn_utils._allocate_kv_cache(cfg, {}, torch.device("cpu"))


# ---------------------------------------------------------------- allocation
def test_v2_allocation_is_pool_backed_with_exact_sizes_and_nothing_mapped(runtime):
    raw = v2_allocate(config())
    pool = runtime.allocation_pool()
    assert pool is not None
    assert set(raw) == {"l0", "l1", "l2"}
    for tensor in raw.values():
        assert tensor.dtype == torch.int8 and tensor.dim() == 1 and tensor.numel() == SIZE
    assert raw["l1"] is raw["l2"]
    assert raw["l0"] is not raw["l1"]
    regions = {name: pool.region_of(tensor) for name, tensor in raw.items()}
    assert regions["l1"] is regions["l2"]
    assert regions["l0"].region_id != regions["l1"].region_id
    assert len(pool.regions) == 2
    for region in regions.values():
        assert region.nbytes == SIZE and region.reserved_bytes == align_up(SIZE, CHUNK)
        assert region.address % CHUNK == 0
    low, high = sorted((regions["l0"], regions["l1"]), key=lambda r: r.address)
    assert low.address + low.reserved_bytes <= high.address
    assert raw["l0"].data_ptr() == regions["l0"].address
    stats = pool.stats()
    assert stats.page_bytes == CHUNK
    assert stats.virtual_bytes == 2 * SIZE
    assert stats.mapped_bytes == 0 and stats.held_bytes == 0 and stats.groups_mapped == 0
    assert stats.pages_created == 0
    assert stats.limit_bytes is None  # start-up warm-up is not limited; the scheduler sets the limit
    assert runtime.cache is None  # nothing is published before vLLM has shaped the views


def test_sizes_that_are_not_whole_chunks_are_padded_in_the_reservation_only(runtime):
    odd = 3 * MIB + 4096
    raw = v2_allocate(config([KVCacheTensor(size=odd, shared_by=["l0", "l1", "l2"])]))
    region = runtime.allocation_pool().region_of(raw["l0"])
    assert raw["l0"].numel() == odd and region.nbytes == odd
    assert region.reserved_bytes == 4 * MIB


def test_packed_entries_share_one_backing(runtime):
    if "block_stride" not in {f.name for f in dataclasses.fields(KVCacheTensor)}:
        pytest.skip("this vLLM has no packed KV tensors (KVCacheTensor.block_stride arrived in 0.24)")
    stride = 3 * BLOCK_BYTES
    cfg = config([KVCacheTensor(size=3 * SIZE, shared_by=["l0"], block_stride=stride),
                  KVCacheTensor(size=3 * SIZE, shared_by=["l1"], block_stride=stride),
                  KVCacheTensor(size=SIZE, shared_by=["l2"])])
    raw = v2_allocate(cfg)
    assert raw["l0"] is raw["l1"]
    assert raw["l2"] is not raw["l0"]
    pool = runtime.allocation_pool()
    assert len(pool.regions) == 2
    assert sorted(r.nbytes for r in pool.regions) == [SIZE, 3 * SIZE]


def test_each_allocation_gets_its_own_pool_and_finish_hands_it_over_once(runtime):
    v2_allocate(config())
    first = runtime.allocation_pool()
    v2_allocate(config())
    second = runtime.allocation_pool()
    assert first is not second
    assert runtime.finish_allocation() is second
    assert runtime.allocation_pool() is None
    assert runtime.finish_allocation() is None


# -------------------------------------------------------------------- V1 runner
def v1_allocate(runner, cfg):
    """Call the runner's (patched) method the way vLLM does, bound to ``runner`` (a stand-in)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    method = vars(GPUModelRunner)["_allocate_kv_cache_tensors"].__get__(runner, GPUModelRunner)
    return method(cfg)


def test_v1_runner_method_allocates_over_the_pool(runtime):
    raw = v1_allocate(types.SimpleNamespace(runner_only_attn_layers=set()), config())
    pool = runtime.allocation_pool()
    assert set(raw) == {"l0", "l1", "l2"} and raw["l1"] is raw["l2"]
    assert pool.region_of(raw["l0"]).nbytes == SIZE
    assert pool.stats().mapped_bytes == 0


def test_v1_runner_method_checks_every_layer_was_allocated(runtime):
    cfg = config(layers=("l0", "l1", "l2", "drafter"))
    with pytest.raises(AssertionError, match="not allocated"):
        v1_allocate(types.SimpleNamespace(runner_only_attn_layers=set()), cfg)
    raw = v1_allocate(types.SimpleNamespace(runner_only_attn_layers={"drafter"}), cfg)
    assert set(raw) == {"l0", "l1", "l2"}


# ---------------------------------------------------------------- publishing
def allocate_and_view(runtime):
    raw = v2_allocate(config())
    views = [flash_view(raw[name]) for name in ("l0", "l1", "l2")]
    return raw, views


def test_publish_views_derives_the_layout_and_maps_warm_up_groups(runtime):
    raw, views = allocate_and_view(runtime)
    pool = runtime.finish_allocation()
    cache = publish_views(runtime, pool, views, N, premap_blocks=300)
    assert runtime.cache is cache and cache.pool is pool
    assert cache.num_blocks == N
    assert cache.blocks_per_group == BLOCKS_PER_GROUP
    assert cache.num_groups == GROUPS
    assert list(cache.blocks_of_group(2)) == list(range(256, 384))
    assert cache.group_of_block(299) == 2
    # each group covers one page of the K half and one of the V half in each of the two tensors
    assert cache.group_bytes == 2 * 2 * CHUNK
    assert pool.mapped_groups() == {0, 1, 2}  # blocks 0..299: the null block and the warm-up blocks
    assert pool.stats().mapped_bytes == 3 * cache.group_bytes
    assert pool.stats().limit_bytes is None


def test_published_blocks_are_usable_memory_and_shared_layers_alias(runtime):
    raw, views = allocate_and_view(runtime)
    publish_views(runtime, runtime.finish_allocation(), views, N, premap_blocks=2 * BLOCKS_PER_GROUP)
    for view in views:
        assert torch.count_nonzero(view[:, :2 * BLOCKS_PER_GROUP]) == 0  # fresh pages read as zeros
    views[0][0, 5].fill_(1.5)
    views[0][1, 255].fill_(-2.0)
    views[1][1, 7].fill_(3.0)
    assert torch.all(views[0][0, 5] == 1.5) and torch.all(views[0][1, 255] == -2.0)
    assert torch.all(views[2][1, 7] == 3.0)  # l1 and l2 are one tensor
    assert torch.count_nonzero(views[1][0, :256]) == 0  # only mapped blocks may be touched
    assert torch.count_nonzero(views[0][0, :256]) == BS * HEADS * HEAD


def test_publish_maps_only_the_null_group_by_default(runtime):
    raw, views = allocate_and_view(runtime)
    pool = runtime.finish_allocation()
    cache = publish_views(runtime, pool, views, N)
    assert pool.mapped_groups() == {0}
    assert pool.stats().mapped_bytes == cache.group_bytes


def test_publish_accepts_nested_and_repeated_views(runtime):
    raw, views = allocate_and_view(runtime)
    pool = runtime.finish_allocation()
    nested = [[views[0]], (views[1], views[2]), None, [views[0], [views[1]]]]
    cache = publish_views(runtime, pool, nested, N, premap_blocks=N + 50)
    assert cache.num_groups == GROUPS and cache.blocks_per_group == BLOCKS_PER_GROUP
    assert pool.mapped_groups() == set(range(GROUPS))  # premap beyond the last block maps everything


def test_startup_blocks_cover_one_batch_of_warm_up(runtime):
    cfg = config()
    runner = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_batched_tokens=2048))
    assert startup_blocks(runner, cfg) == 2 * (2048 // BS) + 2
    runner.scheduler_config.max_num_batched_tokens = 2049
    assert startup_blocks(runner, cfg) == 2 * (2048 // BS + 1) + 2


def test_a_replaced_pool_is_closed_once_its_tensors_are_gone(runtime):
    raw, views = allocate_and_view(runtime)       # vLLM's profiling run
    profiling = runtime.finish_allocation()
    kept_raw, kept_views = allocate_and_view(runtime)  # the real KV cache
    real = runtime.finish_allocation()
    del raw, views
    gc.collect()
    publish_views(runtime, real, kept_views, N)
    assert profiling.regions_alive() == 0
    assert profiling.leak_report() == []
    with pytest.raises(PoolClosedError):
        profiling.add_tensor(CHUNK)
    assert real.regions_alive() == 2
    real.add_tensor(CHUNK)  # the live cache's pool stays open


def test_the_runtime_holds_the_shared_budget_layer_of_the_published_pool_only(runtime):
    raw, views = allocate_and_view(runtime)       # vLLM's profiling run, still alive
    profiling = runtime.finish_allocation()
    kept_raw, kept_views = allocate_and_view(runtime)
    real = runtime.finish_allocation()
    assert runtime.budget is None  # nothing published yet
    publish_views(runtime, real, kept_views, N, premap_blocks=2 * BLOCKS_PER_GROUP)
    budget = runtime.budget
    assert budget is not None and budget.member is None  # counting only, until the scheduler joins
    assert budget.outstanding_bytes == real.stats().held_bytes > 0
    profiling.map_groups([3])  # pages of another pool go through another stack
    assert budget.outstanding_bytes == real.stats().held_bytes
    assert len(raw) == len(kept_raw) == 3 and views and kept_views


def test_a_replaced_pool_whose_tensors_live_is_kept(runtime):
    raw, views = allocate_and_view(runtime)
    old = runtime.finish_allocation()
    new_raw, new_views = allocate_and_view(runtime)
    publish_views(runtime, runtime.finish_allocation(), new_views, N)
    assert old.regions_alive() == 2  # still open: vLLM may still hold these tensors
    del raw, views
    gc.collect()
    runtime.retire_unused_pools()
    assert old.leak_report() == []
    with pytest.raises(PoolClosedError):
        old.add_tensor(CHUNK)


def test_the_process_that_makes_a_pool_takes_the_configured_switch_interval():
    """Where the pool's threads run, they win the GIL back sooner (KVELASTIC_SWITCH_INTERVAL, 0.2 ms unless
    set); ``none`` leaves Python's as it was."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        Runtime(Settings(enabled=True, switch_interval_s=None), backend_factory=HostBackend).new_pool().close()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        Runtime(Settings(enabled=True), backend_factory=HostBackend).new_pool().close()
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        Runtime(Settings(enabled=True, switch_interval_s=0.0007), backend_factory=HostBackend).new_pool().close()
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        sys.setswitchinterval(before)



def test_a_switch_interval_already_in_effect_is_not_set_or_logged_again(caplog):
    """CPython keeps whole microseconds (0.0002 reads back as 0.00019999999999999998): the next pool of
    the process finds the default already in effect."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        runtime = Runtime(Settings(enabled=True), backend_factory=HostBackend)
        with caplog.at_level(logging.INFO, logger="vllm.kvelastic"):
            runtime.new_pool().close()
            runtime.new_pool().close()
        said = [r for r in caplog.records if "thread switch interval" in r.getMessage()]
        assert len(said) == 1
    finally:
        sys.setswitchinterval(before)

# ------------------------------------------------------------------- capacity
def test_plan_capacity_defaults_limit_to_the_profiled_bytes():
    runtime = Runtime(Settings(enabled=True))
    plan = runtime.plan_capacity(profiled_bytes=10 * GIB, device_total_bytes=80 * GIB)
    assert runtime.plan is plan
    assert plan.profiled_bytes == 10 * GIB
    assert plan.limit_bytes == 10 * GIB
    assert plan.virtual_bytes == 80 * GIB


def test_plan_capacity_rounds_virtual_down_to_whole_chunks():
    runtime = Runtime(Settings(enabled=True))  # 8 MiB chunks
    total = 80 * GIB - 3 * MIB
    plan = runtime.plan_capacity(profiled_bytes=10 * GIB, device_total_bytes=total)
    assert plan.virtual_bytes % (8 * MIB) == 0
    assert total - 8 * MIB < plan.virtual_bytes <= total


def test_plan_capacity_honours_limit_and_virtual_settings():
    settings = Settings.from_env({"KVELASTIC": "1", "KVELASTIC_LIMIT": "6GiB",
                                  "KVELASTIC_VIRTUAL_BYTES": "100GiB", "KVELASTIC_CHUNK_SIZE": "32MiB"})
    plan = Runtime(settings).plan_capacity(profiled_bytes=10 * GIB, device_total_bytes=80 * GIB)
    assert plan.limit_bytes == 6 * GIB
    assert plan.virtual_bytes == 100 * GIB
    assert plan.profiled_bytes == 10 * GIB

    odd = Runtime(Settings(enabled=True, virtual_bytes=20 * GIB + 3 * MIB, chunk_bytes=2 * MIB))
    assert odd.plan_capacity(10 * GIB, 80 * GIB).virtual_bytes == 20 * GIB + 2 * MIB


def test_the_limit_never_exceeds_the_virtual_capacity(kv_log):
    plan = Runtime(Settings(enabled=True, limit_bytes=1024 * GIB)).plan_capacity(10 * GIB, 80 * GIB - 3 * MIB)
    assert plan.limit_bytes == plan.virtual_bytes == 80 * GIB - 8 * MIB  # lowered to what the device can hold
    assert "KVELASTIC_LIMIT=1.00 TiB is more than this cache's virtual size" in kv_log.text
    plan = Runtime(Settings(enabled=True)).plan_capacity(profiled_bytes=12 * GIB, device_total_bytes=8 * GIB)
    assert plan.virtual_bytes == 12 * GIB and plan.limit_bytes == 12 * GIB
    with pytest.raises(ConfigError, match="KVELASTIC_LIMIT='4GiB' is larger than KVELASTIC_VIRTUAL_BYTES='2GiB'"):
        Settings.from_env({"KVELASTIC_LIMIT": "4GiB", "KVELASTIC_VIRTUAL_BYTES": "2GiB"})
