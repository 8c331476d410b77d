"""vLLM 0.29+'s one KV backing served by the page pool, with vLLM's own planner and views.

kvelastic's one-backing worker patches (``v1_single_backing`` in band C,
``v2_single_backing`` in bands C and D) are applied through a patcher cleared for
their contacts, on a host-backed runtime: in band C vLLM's ``torch.zeros`` is
served by a stand-in ``torch``, in band D (0.34+) by the ``allocate`` hook. vLLM's real
``get_kv_cache_config_from_groups`` plans each layout, vLLM's real
``allocate_kv_cache`` (through the runner's patched name) builds the views over
the pool's backing, and kvelastic reads the group layout off those views. The
property checked: every byte of every block of every layer lies in the pages of
that block's group, for every layout, page size and kernel block split vLLM
accepts; where the layout allows it, groups also own whole pages.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.29+ (one KV backing)")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvelastic.errors import LayoutError  # noqa: E402
from kvelastic.worker.allocation import publish_views  # noqa: E402
from kvelastic.worker.page_alignment import (  # noqa: E402
    group_blocks_of_config,
    layer_outermost_multiple,
    whole_page_blocks,
)
from kvelastic.startup.runtime import Runtime  # noqa: E402
from kvelastic.worker.single_backing import VIEW_BLOCK_DIM  # noqa: E402
from kvelastic.patching.apply import Patcher  # noqa: E402
from kvelastic.patching.versions import installed_vllm_version  # noqa: E402
from kvelastic.pool import HostBackend  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402

KIB = 1024
CPU = torch.device("cpu")


def _planner():
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # 0.33
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # 0.29-0.32
    return get_kv_cache_config_from_groups


def plan(layout: KVCacheLayout, groups: list, num_blocks: int) -> KVCacheConfig:
    """vLLM's own plan of ``groups`` in ``layout``, with exactly ``num_blocks`` blocks."""
    config = VllmConfig(cache_config=CacheConfig(block_size=groups[0].kv_cache_spec.block_size),
                        device_config=DeviceConfig(device="cpu"))
    config.cache_config.kv_cache_layout = layout.name
    config.cache_config.num_gpu_blocks_override = num_blocks
    return _planner()(config, groups, 1 << 40)


def patcher_for(patch) -> Patcher:
    return Patcher(installed_vllm_version(), patch.targets)


def runners() -> list[str]:
    """The runners the installed release has, each with its one-backing patch (the V1 runner is gone in 0.34)."""
    from kvelastic.patches import v1_single_backing

    return ["v1", "v2"] if v1_single_backing.PATCH.claims(installed_vllm_version()) else ["v2"]


class BandC:
    """A host-backed runtime with every runner's one-backing patch applied, undone on close."""

    def __init__(self, page_bytes: int):
        from kvelastic.patches import v1_single_backing, v2_single_backing

        version = installed_vllm_version()
        patches = [patch for patch in (v1_single_backing.PATCH, v2_single_backing.PATCH) if patch.claims(version)]
        self.runtime = Runtime(Settings(enabled=True, chunk_bytes=page_bytes), backend_factory=HostBackend)
        self.patcher = Patcher(version, tuple(target for patch in patches for target in patch.targets))
        for patch in patches:
            patch.apply(self.patcher, self.runtime)
        self.patchers: list[Patcher] = []  # further patches a test applies, undone first

    def allocate(self, config: KVCacheConfig, layout: KVCacheLayout, kernel_block_size: int | None,
                 runner: str | None = None):
        """Through the name the V1 runner's module calls, or (``runner="v2"``, and the default where the V1
        runner is gone) the V2 runner's ``attn_utils``."""
        import importlib

        modules = {"v1": "vllm.v1.worker.gpu_model_runner", "v2": "vllm.v1.worker.gpu.attn_utils"}
        module = importlib.import_module(modules[runner or runners()[0]])
        sizes = None if kernel_block_size is None else [kernel_block_size] * len(config.kv_cache_groups)
        return module.allocate_kv_cache(config, CPU, layout, sizes)

    def close(self) -> None:
        for patcher in (*self.patchers, self.patcher):
            patcher.revert()
        self.runtime.cache = None
        for engine_pool in list(self.runtime._pools):
            engine_pool.pool.close()


@pytest.fixture
def band_c():
    made: list[BandC] = []

    def make(page_bytes: int = 64 * KIB) -> BandC:
        """A fresh runtime; the one made before (a hypothesis example, a loop's turn) is undone first."""
        while made:
            made.pop().close()
        made.append(BandC(page_bytes))
        return made[-1]

    yield make
    for each in made:
        each.close()


def block_pages(view: torch.Tensor, block: int, num_blocks: int, page_bytes: int) -> set[int]:
    """Pool pages (of the backing) that manager block ``block`` of a per-layer view touches, byte by byte."""
    ratio = view.shape[0] // num_blocks
    rows = view[block * ratio:(block + 1) * ratio]
    size = view.element_size()
    elements = view.untyped_storage().nbytes() // size
    offsets = torch.as_strided(torch.arange(elements), rows.shape, rows.stride(), rows.storage_offset()) * size
    return set((offsets // page_bytes).unique().tolist()) | set(((offsets + size - 1) // page_bytes).unique().tolist())


def vanilla_refusal(config: KVCacheConfig, layout: KVCacheLayout, kernel_block_size: int | None) -> Exception | None:
    """What vLLM's own, unpatched ``allocate_kv_cache`` (a ``torch.zeros`` backing) raises here, if anything.

    0.29-0.31 refuse to split blocks that are not dense pages (``ValueError``); some
    splits of single-layer block-outermost layouts fail in ``torch.as_strided``
    (``RuntimeError``) in vLLM 0.33 itself.
    """
    from vllm.v1.worker.utils import allocate_kv_cache

    sizes = None if kernel_block_size is None else [kernel_block_size] * len(config.kv_cache_groups)
    try:
        allocate_kv_cache(config, CPU, layout, sizes)
    except (ValueError, RuntimeError) as exc:
        return exc
    return None


def specs(heads: int, head_size: int, block_size: int, dtype: torch.dtype, sliding: bool):
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    if not sliding:
        return full
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
                             sliding_window=4 * block_size)


def _misplaced_blocks(views: dict, cache, num_blocks: int, page_bytes: int) -> list[tuple[str, int]]:
    """(layer, block) pairs whose bytes reach outside the pages of the block's group."""
    return [(name, block) for name, view in views.items() for block in range(num_blocks)
            if not block_pages(view, block, num_blocks, page_bytes)
            <= {ref.page for ref in cache.layout.pages(cache.group_of_block(block))}]


def _pages_of_two_groups(cache) -> list[int]:
    """Pages that more than one page group's layout names."""
    owner: dict[int, int] = {}
    return [ref.page for group in range(cache.num_groups) for ref in cache.layout.pages(group)
            if owner.setdefault(ref.page, group) != group]


LAYOUTS = st.sampled_from(list(KVCacheLayout))


@given(layout=LAYOUTS, layers=st.integers(1, 4), groups=st.integers(1, 2), heads=st.integers(1, 4),
       head_size=st.sampled_from([32, 64, 80, 96, 128]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       split=st.integers(1, 3), num_blocks=st.integers(2, 48),
       page_bytes=st.sampled_from([16 * KIB, 64 * KIB, 256 * KIB]), align=st.booleans())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_block_of_every_layer_lies_in_its_groups_pages(band_c, layout, layers, groups, heads, head_size,
                                                             dtype, split, num_blocks, page_bytes, align):
    kernel = 16
    spec_groups = [KVCacheGroupSpec([f"g{g}.l{i}" for i in range(layers)],
                                    specs(heads, head_size, kernel * split, dtype, sliding=g == 1))
                   for g in range(groups)]
    config = plan(layout, spec_groups, num_blocks)
    multiple = layer_outermost_multiple(config, page_bytes)
    if align and multiple is not None and num_blocks >= multiple:  # what whole_page_num_blocks does
        num_blocks -= num_blocks % multiple
        config = plan(layout, spec_groups, num_blocks)
    env = band_c(page_bytes)
    kernel_block_size = kernel if split > 1 else None
    refused = vanilla_refusal(config, layout, kernel_block_size)
    if refused is not None:  # vLLM itself cannot lay this out: kvelastic refuses it the same way
        assert split > 1
        with pytest.raises(type(refused)):  # and no pool tensor reaches a traceback's repr
            env.allocate(config, layout, kernel_block_size)
        return
    views = env.allocate(config, layout, kernel_block_size)
    pool = env.runtime.finish_allocation()
    (region,) = pool.regions
    assert region.nbytes == config.kv_cache_tensors[0].size
    assert pool.stats().mapped_bytes == 0  # nothing is mapped before the layout is published
    k = group_blocks_of_config(config, page_bytes)
    cache = publish_views(env.runtime, pool, views.values(), num_blocks, blocks_per_group=k, block_dim=VIEW_BLOCK_DIM)
    assert cache.layout.blocks_per_group == k
    for name, view in views.items():  # no tensor in an assert: pytest's repr would read unmapped pages
        assert pool.region_of(view).region_id == region.region_id, name
    assert not _misplaced_blocks(views, cache, num_blocks, page_bytes)
    aligned = multiple is None or num_blocks % multiple == 0
    whole = whole_page_blocks(min(t.block_stride for t in config.kv_cache_tensors), page_bytes) is not None
    if aligned and whole:
        assert not _pages_of_two_groups(cache)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_layers_of_one_group_with_different_page_sizes_map_their_blocks_whole(band_c, layout):
    """A group of ``UniformTypeKVCacheSpecs`` (2 and 3 KV heads): under a layer-outermost layout each page
    size steps through the one backing with its own stride, and each stride's layers keep runs of their own."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    page_bytes = 64 * KIB
    narrow, wide = specs(2, 64, 16, torch.bfloat16, False), specs(3, 64, 16, torch.bfloat16, False)
    group = KVCacheGroupSpec(["a0", "a1", "b0"], UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"a0": narrow, "a1": narrow, "b0": wide}))
    num_blocks = 48
    try:
        config = plan(layout, [group], num_blocks)
    except ValueError as refused:  # vLLM's planner: this layout cannot express mixed pages (0.33: LHBNC, BHLNC)
        assert "mixed page sizes" in str(refused)
        assert layout not in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)  # the layouts this is about are planned
        return
    multiple = layer_outermost_multiple(config, page_bytes)
    if multiple is not None:  # what whole_page_num_blocks does
        num_blocks -= num_blocks % multiple
        config = plan(layout, [group], num_blocks)
    env = band_c(page_bytes)
    views = env.allocate(config, layout, None)
    pool = env.runtime.finish_allocation()
    cache = publish_views(env.runtime, pool, views.values(), num_blocks,
                          blocks_per_group=group_blocks_of_config(config, page_bytes), block_dim=VIEW_BLOCK_DIM)
    strides = {runs.block_stride for runs in cache.layout.regions}
    assert len(strides) == (2 if not layout.is_block_outermost else 1)
    assert not _misplaced_blocks(views, cache, num_blocks, page_bytes)
    assert not _pages_of_two_groups(cache)


def _hybrid_groups() -> list:
    """Attention and Mamba-2 layers, as vLLM plans a hybrid model: the Mamba state page padded to the
    attention page (vLLM's hybrid config does so), the state itself a fraction of it."""
    from vllm.v1.kv_cache_interface import MambaSpec

    attention = specs(2, 64, 16, torch.bfloat16, False)
    mamba = MambaSpec(block_size=16, shapes=((3, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.bfloat16),
                      page_size_padded=attention.page_size_bytes)
    return [KVCacheGroupSpec(["attn0", "attn1"], attention), KVCacheGroupSpec(["mamba0", "mamba1"], mamba)]


def _mla_groups() -> list:
    """Multi-head latent attention (DeepSeek-V2's shape): one latent head of 576 per token, K and V in one."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return [KVCacheGroupSpec(["mla0", "mla1", "mla2"],
                             MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))]


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("model", ["hybrid-mamba2", "mla"])
def test_hybrid_and_mla_layers_lie_in_their_groups_pages(band_c, layout, model):
    """A Mamba state and attention KV overlaid in one backing, or MLA's latent cache: every byte of every
    block lies in its group's pages, and in the block-outermost layouts kvelastic asks vLLM for
    (``kv_layout_preference``) no page has two groups. (Layer-outermost, a Mamba block's contiguous state
    and an attention block's K and V halves can start pages apart: LHBNC shares pages between groups,
    which costs granularity, never a byte outside a group's pages.)"""
    page_bytes, num_blocks = 64 * KIB, 48
    groups = _hybrid_groups() if model == "hybrid-mamba2" else _mla_groups()
    config = plan(layout, groups, num_blocks)
    multiple = layer_outermost_multiple(config, page_bytes)
    if multiple is not None:  # what whole_page_num_blocks does
        num_blocks -= num_blocks % multiple
        config = plan(layout, groups, num_blocks)
    env = band_c(page_bytes)
    views = env.allocate(config, layout, None)
    assert set(views) == {name for group in groups for name in group.layer_names}
    pool = env.runtime.finish_allocation()
    cache = publish_views(env.runtime, pool, views.values(), num_blocks,
                          blocks_per_group=group_blocks_of_config(config, page_bytes), block_dim=VIEW_BLOCK_DIM)
    assert not _misplaced_blocks(views, cache, num_blocks, page_bytes)
    if layout.is_block_outermost:
        assert not _pages_of_two_groups(cache)


def test_block_outermost_layouts_cannot_split_kernel_blocks(band_c):
    """Why the layout preference leaves models that split kernel blocks alone (0.29-0.31 fail here)."""
    spec_groups = [KVCacheGroupSpec(["a", "b"], specs(2, 64, 32, torch.bfloat16, sliding=False))]
    for layout in (KVCacheLayout.BLNHC, KVCacheLayout.BLHNC):
        with pytest.raises(ValueError, match="kernel block"):
            band_c().allocate(plan(layout, spec_groups, 8), layout, 16)


@pytest.mark.parametrize("runner", runners())
def test_views_are_vllms_own_over_the_pool_backing(band_c, runner):
    from vllm.v1.worker.utils import allocate_kv_cache

    spec_groups = [KVCacheGroupSpec(["a", "b", "c"], specs(2, 64, 16, torch.bfloat16, sliding=False))]
    for layout in KVCacheLayout:
        config = plan(layout, spec_groups, 40)
        env = band_c()
        pooled = env.allocate(config, layout, None, runner)
        plain = allocate_kv_cache(config, CPU, layout, None)  # vLLM unpatched: torch.zeros
        pool = env.runtime.finish_allocation()
        backing = pool.regions[0]
        cache = publish_views(env.runtime, pool, pooled.values(), 40, block_dim=VIEW_BLOCK_DIM)
        cache.map_groups(range(cache.num_groups))  # touching an unmapped page faults, on the GPU as here
        for name in plain:
            mine, theirs = pooled[name], plain[name]
            assert (mine.shape, mine.stride(), mine.dtype) == (theirs.shape, theirs.stride(), theirs.dtype)
            assert mine.data_ptr() - backing.address == theirs.data_ptr() - theirs.untyped_storage().data_ptr()
            assert mine.untyped_storage().nbytes() == config.kv_cache_tensors[0].size
            assert not mine.any()  # fresh pages read as zeros, like torch.zeros
            mine.copy_(torch.randn(mine.shape).to(mine.dtype))
            theirs.copy_(mine)
            assert torch.equal(mine, theirs)


def test_another_wrapper_around_vllms_allocator_is_refused(band_c):
    """kvelastic runs vLLM's own function with a stand-in torch: a wrapper in between would hide it."""
    import functools

    from vllm.v1.worker import utils

    from kvelastic.errors import PatchError
    from kvelastic.worker.single_backing import allocate_in_pool

    env = band_c()
    config = plan(KVCacheLayout.BLNHC, [KVCacheGroupSpec(["a"], specs(1, 64, 16, torch.bfloat16, False))], 8)
    wrapped = functools.wraps(utils.allocate_kv_cache)(lambda *args, **kwargs: utils.allocate_kv_cache(*args))
    with pytest.raises(PatchError, match="something else wraps"):
        allocate_in_pool(env.runtime, wrapped, (config, CPU, KVCacheLayout.BLNHC, None), {},
                         is_host_resident=lambda tensor: False)
    assert env.runtime.allocation_pool() is None


def _takes_hook() -> bool:
    from kvelastic.patches import single_backing

    return single_backing.ALLOCATE_HOOK in single_backing.ALLOCATOR.shape(installed_vllm_version()).params


@pytest.mark.skipif(not _takes_hook(), reason="vLLM 0.34+ (band D): allocate_kv_cache's allocate hook")
def test_a_backing_hook_already_given_is_refused_before_anything_is_allocated(band_c):
    """With kvelastic on, vLLM's extensible cache is off: a hook passed in means something else serves the KV."""
    from vllm.v1.worker.gpu import attn_utils

    from kvelastic.errors import PatchError

    env = band_c()
    config = plan(KVCacheLayout.BLNHC, [KVCacheGroupSpec(["a"], specs(1, 64, 16, torch.bfloat16, False))], 8)
    asked: list[int] = []
    with pytest.raises(PatchError, match="extensible KV cache"):
        attn_utils.allocate_kv_cache(config, CPU, KVCacheLayout.BLNHC, None,
                                     allocate=lambda size: asked.append(size) or torch.zeros(size, dtype=torch.int8))
    assert asked == [] and env.runtime.allocation_pool() is None


@pytest.mark.skipif(not _takes_hook(), reason="vLLM 0.34+ (band D): allocate_kv_cache's allocate hook")
def test_the_hook_serves_one_backing_and_refuses_a_second(band_c):
    """kvelastic's hook reserves the size vLLM asks, once, in a new pool: vLLM's own function runs unchanged."""
    from kvelastic.worker.single_backing import PoolBacking

    env = band_c()
    hook = PoolBacking(env.runtime, CPU)
    backing = hook(8 * KIB)
    assert backing.dtype == torch.int8 and backing.numel() == 8 * KIB  # nothing mapped yet: not read
    (region,) = env.runtime.allocation_pool().regions
    assert region.address == backing.data_ptr() and hook.backing is backing
    with pytest.raises(LayoutError, match="second"):
        hook(8 * KIB)
    with pytest.raises(LayoutError, match="bytes"):
        PoolBacking(env.runtime, CPU)(0)


def test_an_empty_config_allocates_no_pool(band_c):
    env = band_c()
    config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    assert env.allocate(config, KVCacheLayout.LBNHC, None) == {}
    assert env.runtime.finish_allocation() is None


def test_host_resident_tensors_are_refused_before_any_allocation(band_c):
    from kvelastic.patches.kv_cache_objects import KV_CACHE_TENSOR

    env = band_c()
    if "host_resident" not in env.patcher.attributes(KV_CACHE_TENSOR):
        pytest.skip("this vLLM has no host-resident KV tensors (0.30+)")
    config = plan(KVCacheLayout.LBNHC, [KVCacheGroupSpec(["a"], specs(1, 64, 16, torch.bfloat16, False))], 8)
    config.kv_cache_tensors[0].host_resident = True
    with pytest.raises(LayoutError, match="host-resident"):
        env.allocate(config, KVCacheLayout.LBNHC, None)
    assert env.runtime.finish_allocation() is None


def test_layers_without_views_are_refused(band_c):
    from vllm.v1 import kv_cache_interface

    resident = vars(kv_cache_interface).get("HiSparseResidentSpec")
    if resident is None:
        pytest.skip("this vLLM has no spec without per-layer views (0.30+)")
    spec = resident(block_size=16, page_size=4 * KIB)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[KVCacheTensor(size=32 * KIB, layers=["h"],
                                                                         layer_stride=4 * KIB, block_stride=4 * KIB)],
                           kv_cache_groups=[KVCacheGroupSpec(["h"], spec)])
    with pytest.raises(LayoutError, match="raw KV backing"):
        band_c().allocate(config, KVCacheLayout.LBNHC, None)


def test_hisparse_allocation_is_refused_with_a_clear_message(band_c):
    pytest.importorskip("vllm.v1.hisparse.binding", reason="HiSparse arrived in vLLM 0.30")
    from vllm.v1.hisparse import binding

    from kvelastic.patches import hisparse_refusal

    env = band_c()
    patcher = patcher_for(hisparse_refusal.PATCH)
    hisparse_refusal.PATCH.apply(patcher, env.runtime)
    env.patchers.append(patcher)
    config = plan(KVCacheLayout.LBNHC, [KVCacheGroupSpec(["a"], specs(1, 64, 16, torch.bfloat16, False))], 8)
    with pytest.raises(LayoutError, match="HiSparse"):
        binding.allocate_kv_cache(config, CPU, KVCacheLayout.LBNHC, None)
    assert env.runtime.allocation_pool() is None


def test_a_second_backing_or_another_dtype_is_refused():
    from kvelastic.worker.single_backing import PoolZeros

    zeros = PoolZeros(Runtime(Settings(enabled=True, chunk_bytes=64 * KIB), backend_factory=HostBackend))
    with pytest.raises(LayoutError, match="int8"):
        zeros.zeros(4096, dtype=torch.float16, device=CPU)
    zeros.zeros(4096, dtype=torch.int8, device=CPU)
    with pytest.raises(LayoutError, match="second"):
        zeros.zeros(4096, dtype=torch.int8, device=CPU)
    assert zeros.int8 is torch.int8 and zeros.as_strided is torch.as_strided  # the rest is torch's own


def _runner(layout: KVCacheLayout, env: BandC, sleep_mode: bool = False):
    """What ``publish_one_backing`` reads of a model runner; its ``initialize_kv_cache`` allocates through
    the patched name and keeps the views, as both runners do (a real runner needs a GPU model)."""
    import copy
    import types

    from tests.scheduler_harness import vllm_config

    config = copy.deepcopy(vllm_config(64))
    config.model_config.enable_sleep_mode = sleep_mode
    runner = types.SimpleNamespace(vllm_config=config, scheduler_config=config.scheduler_config, kv_caches=[])

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None):
        self.kv_caches = list(env.allocate(kv_cache_config, layout, None).values())

    return runner, types.MethodType(initialize_kv_cache, runner)


@pytest.mark.parametrize("layout", [KVCacheLayout.BLNHC, KVCacheLayout.LBNHC], ids=lambda layout: layout.name)
def test_initialize_publishes_whole_page_groups_of_the_one_backing(band_c, layout):
    from kvelastic.worker.single_backing import publish_one_backing

    env = band_c(64 * KIB)
    spec_groups = [KVCacheGroupSpec(["a", "b", "c"], specs(2, 64, 16, torch.bfloat16, sliding=False))]
    config = plan(layout, spec_groups, 256)
    runner, initialize = _runner(layout, env)
    publish_one_backing(env.runtime, initialize, runner, (config,), {}, connector_has_pool=lambda: False,
                        outside_access=lambda _: None)
    cache = env.runtime.cache
    assert cache is not None and env.runtime.allocation_pool() is None
    assert cache.blocks_per_group == group_blocks_of_config(config, 64 * KIB)
    (region,) = cache.layout.regions
    assert region.block_stride == config.kv_cache_tensors[0].block_stride
    assert len(region.runs) == (1 if layout.is_block_outermost else 3)  # one range, or one per layer
    assert cache.pool.is_mapped(0)  # the null block's group, and start-up warm-up's


@pytest.mark.parametrize("executor", [None, "mp"], ids=["in-process", "worker-ranks"])
def test_sleep_mode_is_served_in_process_and_refused_under_worker_ranks_before_anything_is_allocated(band_c,
                                                                                                   executor):
    """In one process the engine core gives the pages back on sleep (``patches/sleep_mode.py``); under worker
    ranks it could not, so sleep mode stops the KV cache's initialisation there."""
    from kvelastic.errors import PatchError
    from kvelastic.worker.single_backing import publish_one_backing

    env = band_c()
    config = plan(KVCacheLayout.BLNHC, [KVCacheGroupSpec(["a"], specs(1, 64, 16, torch.bfloat16, False))], 8)
    runner, initialize = _runner(KVCacheLayout.BLNHC, env, sleep_mode=True)
    runner.vllm_config.parallel_config.distributed_executor_backend = executor
    if executor is None:
        publish_one_backing(env.runtime, initialize, runner, (config,), {}, connector_has_pool=lambda: False,
                        outside_access=lambda _: None)
        assert env.runtime.cache is not None and env.runtime.cache.pool.is_mapped(0)
        return
    with pytest.raises(PatchError, match="sleep mode .* under worker ranks"):
        publish_one_backing(env.runtime, initialize, runner, (config,), {}, connector_has_pool=lambda: False,
                        outside_access=lambda _: None)
    assert env.runtime.allocation_pool() is None and env.runtime.cache is None


def test_a_connector_with_its_own_kv_memory_pool_is_refused_before_anything_is_allocated(band_c, monkeypatch):
    """0.31+: vLLM allocates the KV cache inside a connector's ``get_mem_pool_context()``; kvelastic cannot."""
    import contextlib

    from vllm.distributed.kv_transfer import kv_transfer_state

    from kvelastic.errors import ConnectorUnsupported
    from kvelastic.worker.single_backing import publish_one_backing
    from kvelastic.patches import kv_connector_pool

    env = band_c()
    has_pool = kv_connector_pool.connector_pool_test(env.patcher)
    assert has_pool() is False  # no connector in this process
    if not env.patcher.declares(kv_connector_pool.MEM_POOL_CONTEXT):
        assert has_pool is kv_connector_pool._no_connector_pool  # before 0.31 no connector can ask
        return

    class PoolConnector:  # what vLLM reads of a connector here: the one method
        def __init__(self, context):
            self.context = context

        def get_mem_pool_context(self):
            return self.context

    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", PoolConnector(None))
    assert has_pool() is False  # a connector that uses vLLM's default pool is fine
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", PoolConnector(contextlib.nullcontext()))
    assert has_pool() is True
    config = plan(KVCacheLayout.BLNHC, [KVCacheGroupSpec(["a"], specs(1, 64, 16, torch.bfloat16, False))], 8)
    runner, initialize = _runner(KVCacheLayout.BLNHC, env)
    with pytest.raises(ConnectorUnsupported, match="memory pool of its own"):
        publish_one_backing(env.runtime, initialize, runner, (config,), {}, connector_has_pool=has_pool,
                            outside_access=lambda _: None)
    assert env.runtime.allocation_pool() is None and env.runtime.cache is None
