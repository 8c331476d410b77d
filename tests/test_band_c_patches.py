"""The band-C patches (vLLM 0.29-0.33) that decide things, against the installed vLLM 0.29+.

Every band-C contact is checked against each release's source by the version
matrix (``tests/test_version_matrix.py``). Here the decisions run against vLLM
itself: the layout preference with vLLM's real attention backends, specs and
``select_common_block_size``; the whole-page rounding through the engine core's
real ``get_kv_cache_configs``; the ``release_kv_cache_memory`` refusal on vLLM's
real ``EngineCore`` method. Skipped where vLLM 0.29+ is not installed.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.29+ installed (band C)")

import torch  # noqa: E402

from kvelastic.startup.runtime import Runtime  # noqa: E402
from kvelastic.patches import kv_layout_preference, whole_page_num_blocks  # noqa: E402
from kvelastic.patching.apply import Patcher  # noqa: E402
from kvelastic.patching.spec import Patch  # noqa: E402
from kvelastic.patching.versions import installed_vllm_version  # noqa: E402
from kvelastic.pool import HostBackend  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402

KIB = 1024


def patcher_for(patch: Patch) -> Patcher:
    """A patcher cleared for ``patch``'s contacts on the installed release, as the gate would build it."""
    version = installed_vllm_version()
    assert patch.claims(version), f"{patch.name} does not claim vLLM {version}"
    return Patcher(version, patch.targets)


def attention(block_size: int, heads: int = 2):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16)


def _allows():
    from kvelastic.worker.layout_preference import plain_attention, whole_blocks_everywhere

    select = kv_layout_preference.common_block_size(patcher_for(kv_layout_preference.PATCH))

    def allows(specs, backends):
        return whole_blocks_everywhere(specs, backends, select, plain_attention)

    return allows


def test_flashinfer_blocks_that_it_would_split_keep_vllms_order():
    """vLLM 0.34's FlashInfer backend imports flashinfer itself, which its CPU test venv leaves out."""
    pytest.importorskip("flashinfer", reason="vLLM's FlashInfer backend needs the flashinfer package")
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    allows = _allows()
    assert allows([attention(64)], [FlashInferBackend])
    assert not allows([attention(128)], [FlashInferBackend])      # FlashInfer would split into 64s
    assert not allows([attention(128)], [FlashAttentionBackend, FlashInferBackend])


def test_block_outermost_is_preferred_only_where_backends_take_the_block_whole():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    allows = _allows()
    assert allows([attention(16)] * 3, [FlashAttentionBackend])
    assert allows([attention(128)], [FlashAttentionBackend])      # FlashAttention takes multiples of 16
    assert not allows([attention(16), attention(16, heads=4)], [FlashAttentionBackend])  # mixed pages
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    assert not allows([attention(16), mamba], [FlashAttentionBackend])
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert not allows([mla], [FlashAttentionBackend])
    assert not allows([], [FlashAttentionBackend]) and not allows([attention(16)], [])


def test_the_release_decides_how_vllms_common_block_size_is_asked():
    """0.32 added ``kv_cache_specs``; the declaration, not a signature probe, picks the call."""
    import inspect

    from vllm.v1.worker.utils import select_common_block_size

    patcher = patcher_for(kv_layout_preference.PATCH)
    select = kv_layout_preference.common_block_size(patcher)
    per_spec = "kv_cache_specs" in inspect.signature(select_common_block_size).parameters
    assert (select is kv_layout_preference._select_per_spec) == per_spec
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    assert select(32, [FlashAttentionBackend], attention(32)) == 32


def test_the_reorder_keeps_every_layout_and_puts_block_outermost_first():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvelastic.worker.layout_preference import block_outermost_first

    reported = [layout.name for layout in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    moved = block_outermost_first(reported, lambda name: KVCacheLayout[name].is_block_outermost)
    assert sorted(moved) == sorted(reported)
    outer = [name for name in moved if KVCacheLayout[name].is_block_outermost]
    assert outer and moved[:len(outer)] == outer
    assert [n for n in moved if n not in outer] == [n for n in reported if n not in outer]


def test_the_wrapped_worker_reports_vllms_layouts_reordered_and_reverts(monkeypatch):
    """The patch on vLLM's real ``WorkerBase``: a worker of plain attention layers gets block-outermost first.

    The backends are what a loaded model's attention layers would report (none load on a CPU).
    """
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import worker_base

    from tests.scheduler_harness import vllm_config

    class PlainWorker(worker_base.WorkerBase):
        def get_kv_cache_spec(self):
            return {f"layer.{i}": attention(16) for i in range(3)}

    worker = PlainWorker.__new__(PlainWorker)
    worker.vllm_config = vllm_config(64)
    monkeypatch.setattr(worker_base, "get_current_attn_backends", lambda config, layer_names=None: [FlashAttentionBackend])
    vanilla = worker.get_supported_kv_cache_layouts()
    patcher = patcher_for(kv_layout_preference.PATCH)
    kv_layout_preference.PATCH.apply(patcher, None)
    try:
        preferred = worker.get_supported_kv_cache_layouts()
    finally:
        patcher.revert()
    assert worker.get_supported_kv_cache_layouts() == vanilla
    assert sorted(preferred) == sorted(vanilla) and preferred != vanilla
    assert KVCacheLayout[preferred[0]].is_block_outermost
    assert not KVCacheLayout[vanilla[0]].is_block_outermost  # FlashAttention's own first choice is LBNHC


@pytest.fixture
def engine_core_planning():
    """vLLM's engine-core ``get_kv_cache_configs`` through the whole-page patch, on a host runtime."""
    runtime = Runtime(Settings(enabled=True, chunk_bytes=64 * KIB), backend_factory=HostBackend)
    patcher = patcher_for(whole_page_num_blocks.PATCH)
    whole_page_num_blocks.PATCH.apply(patcher, runtime)
    yield
    patcher.revert()


def _plan(layout: str, blocks: int, override: int | None = None):
    from vllm.v1.engine import core

    from tests.scheduler_harness import vllm_config

    config = copy.deepcopy(vllm_config(64))
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks_override = override
    spec = attention(16)  # 8 KiB pages
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(3)}]
    args = [config, specs, [blocks * 3 * spec.page_size_bytes + 100]]
    if "global_kv_cache_groups" in patcher_for(whole_page_num_blocks.PATCH).params(whole_page_num_blocks.TARGET):
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
