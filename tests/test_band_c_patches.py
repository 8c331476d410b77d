"""The band-C patches (vLLM 0.29-0.33) against those releases' sources and, where installed, vLLM itself.

The static part runs in every venv: each release's source is fetched once
(cached) and every target the band-C patches declare is found there with the
declared parameters; the one contact the allocation relies on inside vLLM's
own function (a single ``torch.zeros`` backing) is checked in each source too.
The rest needs vLLM 0.29+ installed and runs against the real engine-core
planner, attention backends and layout enum.
"""

from __future__ import annotations

import ast
import copy
import functools

import pytest

from kvelastic.patching import static_check, vllm_source
from kvelastic.patching.versions import Version
from kvelastic.patches import (
    hisparse_refusal,
    kv_layout_preference,
    single_backing_allocation,
    single_backing_publish,
    whole_page_num_blocks,
)
from kvelastic.patches._band_c import BAND_C

BAND_C_PATCHES = (single_backing_allocation.PATCH, single_backing_publish.PATCH, hisparse_refusal.PATCH,
                  kv_layout_preference.PATCH, whole_page_num_blocks.PATCH)
BAND_C_RELEASES = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
KIB = 1024


@functools.lru_cache(maxsize=None)
def sources() -> dict:
    return vllm_source.fetch_all(BAND_C_RELEASES)


def _root(release: str):
    found = sources()[release]
    if isinstance(found, Exception):
        pytest.fail(f"vLLM {release}'s source could not be fetched: {found}")
    return found


def test_every_band_c_patch_declares_each_release_it_claims():
    for patch in BAND_C_PATCHES:
        assert patch.versions.low >= BAND_C.low and patch.versions.high <= BAND_C.high
        for release in BAND_C_RELEASES:
            if patch.claims(Version.parse(release)):
                assert all(t.expected_params(Version.parse(release)) for t in patch.targets), (patch.name, release)


@pytest.mark.matrix
@pytest.mark.parametrize("release", BAND_C_RELEASES)
def test_release_source_matches_every_band_c_patch(release):
    assert static_check.check_release(_root(release), Version.parse(release), BAND_C_PATCHES) == []


@pytest.mark.matrix
@pytest.mark.parametrize("release", BAND_C_RELEASES)
def test_allocate_kv_cache_makes_one_int8_backing_with_torch_zeros(release):
    """What ``single_backing.PoolZeros`` stands in for: one ``torch.zeros(size, dtype=torch.int8, device=...)``."""
    tree = ast.parse((_root(release) / "vllm" / "v1" / "worker" / "utils.py").read_text())
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "allocate_kv_cache"]
    used = [n for n in ast.walk(function)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "torch"]
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"]
    assert [c.func.attr for c in calls] == ["zeros"]
    assert {n.attr for n in used} <= {"zeros", "int8", "Tensor", "device"}  # annotations and the dtype
    (zeros,) = calls
    assert {k.arg for k in zeros.keywords} == {"dtype", "device"} and len(zeros.args) == 1
    assert ast.unparse(next(k.value for k in zeros.keywords if k.arg == "dtype")) == "torch.int8"


# ----------------------------------------------------------- vLLM 0.29+ installed
def _installed() -> Version:
    pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.29+ installed")
    from kvelastic.patching.versions import installed_vllm_version

    return installed_vllm_version()


def test_the_import_gate_accepts_every_band_c_target_on_installed_vllm():
    from kvelastic.patching.gate import check_target

    version = _installed()
    problems = [p for patch in BAND_C_PATCHES if patch.claims(version) for t in patch.targets
                if (p := check_target(t, version))]
    assert problems == []


def test_block_outermost_is_preferred_only_where_backends_take_the_block_whole():
    _installed()
    import torch
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, MambaSpec
    from vllm.v1.worker.utils import select_common_block_size

    from kvelastic.integration.layout_preference import whole_blocks_everywhere

    def attention(block_size, heads=2):
        return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16)

    def allows(specs, backends):
        return whole_blocks_everywhere(specs, backends, select_common_block_size, AttentionSpec)

    assert allows([attention(16)] * 3, [FlashAttentionBackend])
    assert allows([attention(128)], [FlashAttentionBackend])      # FlashAttention takes multiples of 16
    assert allows([attention(64)], [FlashInferBackend])
    assert not allows([attention(128)], [FlashInferBackend])      # FlashInfer would split into 64s
    assert not allows([attention(128)], [FlashAttentionBackend, FlashInferBackend])
    assert not allows([attention(16), attention(16, heads=4)], [FlashAttentionBackend])  # mixed pages
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    assert not allows([attention(16), mamba], [FlashAttentionBackend])
    assert not allows([], [FlashAttentionBackend]) and not allows([attention(16)], [])


def test_the_reorder_keeps_every_layout_and_puts_block_outermost_first():
    _installed()
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvelastic.integration.layout_preference import block_outermost_first

    reported = [layout.name for layout in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    moved = block_outermost_first(reported, lambda name: KVCacheLayout[name].is_block_outermost)
    assert sorted(moved) == sorted(reported)
    outer = [name for name in moved if KVCacheLayout[name].is_block_outermost]
    assert outer and moved[:len(outer)] == outer
    assert [n for n in moved if n not in outer] == [n for n in reported if n not in outer]


@pytest.fixture
def engine_core_planning():
    """vLLM's engine-core ``get_kv_cache_configs`` through the whole-page patch, on a host runtime."""
    _installed()
    from kvelastic.integration.runtime import Runtime
    from kvelastic.patching.apply import Patcher
    from kvelastic.pool import HostBackend
    from kvelastic.settings import Settings

    runtime = Runtime(Settings(enabled=True, chunk_bytes=64 * KIB), backend_factory=HostBackend)
    patcher = Patcher()
    whole_page_num_blocks.PATCH.apply(patcher, runtime)
    yield
    patcher.revert()


def _plan(layout: str, blocks: int, override: int | None = None):
    import inspect

    import torch
    from vllm.v1.engine import core
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tests.scheduler_harness import vllm_config

    config = copy.deepcopy(vllm_config(64))
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks_override = override
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)  # 8 KiB pages
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(3)}]
    args = [config, specs, [blocks * 3 * spec.page_size_bytes + 100]]
    if "global_kv_cache_groups" in inspect.signature(core.get_kv_cache_configs).parameters:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

        args.append(get_global_kv_cache_groups(config, specs))
    return config, core.get_kv_cache_configs(*args)


def test_layer_outermost_block_count_is_rounded_so_layers_start_on_pages(engine_core_planning):
    config, (planned,) = _plan("LBNHC", 1003)
    assert planned.num_blocks == 1000  # 8 KiB pages: layer l starts at l * 8 KiB * N, 64 KiB | that iff 8 | N
    (tensor,) = planned.kv_cache_tensors
    assert tensor.size == 3 * 8 * KIB * 1000
    assert all((tensor.offset + layer * tensor.layer_stride) % (64 * KIB) == 0 for layer in range(3))
    assert config.cache_config.num_gpu_blocks_override is None  # kvelastic's override was temporary


def test_block_outermost_and_user_overrides_are_left_as_planned(engine_core_planning):
    assert _plan("BLNHC", 1003)[1][0].num_blocks == 1003
    assert _plan("LBNHC", 1000)[1][0].num_blocks == 1000
    config, (planned,) = _plan("LBNHC", 1003, override=901)
    assert planned.num_blocks == 901 and config.cache_config.num_gpu_blocks_override == 901
