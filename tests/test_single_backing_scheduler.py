"""vLLM 0.29+'s real Scheduler over a band-C cache: one backing, vLLM's views, kvelastic's pages.

The KV cache is planned by vLLM's planner, allocated through the patched
``allocate_kv_cache`` and published in whole-page groups, for a block-outermost
and a layer-outermost layout. The scheduler is patched by
``scheduler_block_pool`` as in the older bands. A stand-in forward pass writes,
into every layer's view, a stamp derived from each block's token prefix, and
checks the stamps of every block the scheduler says is already computed
(including prefix-cache hits and blocks reloaded from the host tier). A block
served from an unmapped, recycled or overwritten page fails the check.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.29+ (one KV backing)")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvelastic.worker.allocation import publish_views  # noqa: E402
from kvelastic.worker.page_alignment import group_blocks_of_config, layer_outermost_multiple  # noqa: E402
from kvelastic.worker.single_backing import VIEW_BLOCK_DIM  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from tests.kv_fixtures import BS, D, H, N  # noqa: E402
from tests.scheduler_harness import PatchedSchedulers, check_every_step, drive, make_scheduler  # noqa: E402
from tests.scheduler_harness import make_requests, repeat_waves  # noqa: E402
from tests.test_single_backing import BandC, plan  # noqa: E402

KIB = 1024
PAGE = 16 * KIB  # 4 KiB per layer and block (bf16, 2 heads of 32): several groups in 256 blocks
LAYERS = ("l0", "l1", "l2")  # the layer names the harness's scheduler config uses
LAYOUTS = [KVCacheLayout.BLNHC, KVCacheLayout.LBNHC]


def published(config, layout: KVCacheLayout, envs: list[BandC]) -> tuple[dict, object, object]:
    """vLLM's views of ``config`` (planned in ``layout``) allocated through the patched allocator of a new
    band-C runtime (kept in ``envs`` for closing), and the pool and cache published over them."""
    multiple = layer_outermost_multiple(config, PAGE)
    assert multiple is None or N % multiple == 0  # the layout's groups own whole pages
    env = BandC(PAGE)
    envs.append(env)
    views = env.allocate(config, layout, None)
    pool = env.runtime.finish_allocation()
    cache = publish_views(env.runtime, pool, views.values(), N, premap_blocks=1,
                          blocks_per_group=group_blocks_of_config(config, PAGE), block_dim=VIEW_BLOCK_DIM)
    return views, pool, cache


@pytest.fixture
def band_c_scheduler(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    schedulers = PatchedSchedulers()
    envs: list[BandC] = []

    def make(layout: KVCacheLayout, limit_blocks: int | None = None, **settings):
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
        config = plan(layout, [KVCacheGroupSpec(list(LAYERS), spec)], N)
        views, pool, cache = published(config, layout, envs)
        group_bytes = len(cache.layout.pages(1)) * PAGE
        limit = limit_blocks and -(-limit_blocks // cache.blocks_per_group) * group_bytes
        if limit:
            pool.set_limit(limit)
        scheduler = schedulers.make(pool, views, cache, Settings(enabled=True, chunk_bytes=PAGE, limit_bytes=limit,
                                                                 **settings))
        return scheduler, pool, views, cache

    yield make
    schedulers.close()
    for env in envs:
        env.close()


def stamp(tokens: list[int]) -> float:
    """A small integer (exact in bf16) that depends on every token of a block's prefix."""
    return float(hash(tuple(tokens)) % 200 + 1)


def stamping_forward(views: dict, pool, cache, checked: list):
    """A forward pass: check the stamps of blocks computed before this step, write those this step fills."""

    def forward(scheduler, out) -> None:
        for rid, scheduled in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            after = request.num_computed_tokens
            before = after - scheduled
            tokens = request.all_token_ids
            (block_ids,) = scheduler.kv_cache_manager.get_block_ids(rid)
            for index, block in enumerate(block_ids):
                end = (index + 1) * BS
                if end > after:
                    break
                assert pool.is_mapped(cache.group_of_block(block)), (rid, index, block)
                expected = stamp(tokens[:end])
                for view in views.values():
                    if end <= before:
                        checked.append(bool((view[block] == expected).all()))
                        assert checked[-1], f"{rid} block {index} (id {block}) lost its KV"
                    else:
                        view[block].fill_(expected)

    return forward


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_with_memory_to_spare_the_schedule_is_vanillas_and_every_hit_reads_its_own_kv(band_c_scheduler, layout):
    vanilla = drive(make_scheduler(), repeat_waves())
    scheduler, pool, views, cache = band_c_scheduler(layout)
    checked: list[bool] = []
    trace = drive(scheduler, repeat_waves(), forward=stamping_forward(views, pool, cache, checked),
                  after_step=check_every_step(pool))
    assert trace == vanilla
    assert len(checked) > 100  # the second wave's prefix hits were read back


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("cpu", [False, True], ids=["no-host-tier", "host-tier"])
def test_under_a_tight_limit_blocks_keep_their_kv_through_eviction_and_reload(band_c_scheduler, layout, cpu):
    settings = {"cpu_bytes": 16 * 1024 * 1024} if cpu else {}  # room for every block the test caches
    scheduler, pool, views, cache = band_c_scheduler(layout, limit_blocks=96, cache_ttl_s=0.0, **settings)
    checked: list[bool] = []
    mapped: list[int] = []
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]  # 100+ blocks a wave
    waves = [make_requests("a", 4, 320, 320, seed=0), *filler, make_requests("b", 4, 320, 320, seed=0)]
    trace = drive(scheduler, waves, forward=stamping_forward(views, pool, cache, checked),
                  after_step=check_every_step(pool, mapped))
    assert {rid for step in trace for rid, _ in step} >= {f"b-{i}" for i in range(4)}
    assert not scheduler.has_requests()
    limit = pool.stats().limit_bytes
    assert limit - cache.group_bytes < max(mapped) <= limit  # the limit was reached and held
    if cpu:
        assert scheduler.kvelastic_offload.tier.hits > 0  # some of a's prefix came back from the host
        assert checked  # and its stamps were read back
