"""Band D (vLLM 0.34+): vLLM's extensible KV cache turned off, and a second server's start on a shared GPU.

vLLM 0.34 asks every worker whether it can back its extensible KV cache and turns
it off everywhere on any reason; its ``request_memory`` then refuses to start an
engine when less than ``gpu_memory_utilization`` (0.92 unset) of the GPU is free.
These run vLLM's own ``Worker`` methods, ``Executor.disable_extensible_kv_cache``
and ``request_memory`` on objects built without a GPU: only the memory snapshot
(free and total bytes) and the executor's RPC, which calls the worker in-process,
are stood in for. Skipped below 0.34.
"""

from __future__ import annotations

import math
import types

import pytest

pytest.importorskip("vllm.v1.worker.extensible_kv_cache", reason="needs vLLM 0.34+ installed (band D)")

from kvelastic.patches import extensible_kv_cache  # noqa: E402
from kvelastic.patching.apply import Patcher  # noqa: E402
from kvelastic.patching.versions import installed_vllm_version  # noqa: E402
from kvelastic.worker.extensible import REASON  # noqa: E402

GIB = 1 << 30
TOTAL = 80 * GIB


@pytest.fixture
def patched():
    """The ``extensible_kv_cache`` patch applied as the gate would, undone afterwards."""
    patcher = Patcher(installed_vllm_version(), extensible_kv_cache.PATCH.targets)
    extensible_kv_cache.PATCH.apply(patcher, None)
    yield patcher
    patcher.revert()


def snapshot(free: int):
    """What ``request_memory`` reads of vLLM's ``MemorySnapshot``: free and total bytes of the device."""
    from vllm.utils.mem_utils import MemorySnapshot

    return MemorySnapshot(free_memory=free, total_memory=TOTAL, auto_measure=False, device="cpu")


def cache_config(utilization: float | None = None, extensible: bool = False):
    from vllm.config import CacheConfig

    config = CacheConfig(gpu_memory_utilization=utilization)
    config.enable_extensible_kv_cache = extensible
    return config


def worker(free: int, config):
    """vLLM's ``Worker`` with what its memory methods read, built without a device."""
    from vllm.model_executor.model_loader.weight_cache.utils import ExternalWeightCharges
    from vllm.v1.worker.gpu_worker import Worker

    made = object.__new__(Worker)
    made.init_snapshot = snapshot(free)
    made.cache_config = config
    made.vllm_config = types.SimpleNamespace(cache_config=config)
    made._external_weight_charges = ExternalWeightCharges()
    return made


def test_vanilla_refuses_the_second_server_that_kvelastic_starts(patched):
    """A first server holds 60 GiB: vLLM's estimate-based rule refuses the second, kvelastic's cap does not."""
    from vllm.v1.worker import gpu_worker, utils

    config = cache_config()  # unset, as a plain `vllm serve` leaves it
    estimate_share = config.resolved_gpu_memory_utilization  # vLLM's default without its extensible cache
    assert 0.5 < estimate_share < 1.0
    with pytest.raises(ValueError, match="Free memory on device"):
        utils.request_memory(snapshot(20 * GIB), config)  # vLLM's own function, unpatched
    assert gpu_worker.request_memory(snapshot(20 * GIB), config, 0) == math.ceil(TOTAL * estimate_share)
    assert config.enable_extensible_kv_cache is False and config.gpu_memory_utilization is None  # left as it was
    while_extensible = cache_config(extensible=True)  # a worker's start, before vLLM turns its cache off
    assert gpu_worker.request_memory(snapshot(20 * GIB), while_extensible, 0) == TOTAL
    explicit = cache_config(0.4)
    assert gpu_worker.request_memory(snapshot(2 * GIB), explicit, 0) == math.ceil(TOTAL * 0.4)
    with pytest.raises(ValueError, match="exceed the desired GPU memory utilization"):
        gpu_worker.request_memory(snapshot(2 * GIB), explicit, 40 * GIB)  # vLLM's other refusal still stands


def test_every_worker_gives_kvelastics_reason_and_vllm_turns_its_cache_off_everywhere(patched):
    """vLLM's executor asks every worker, disables on the first reason, then each worker re-resolves its budget."""
    from vllm.config import KVTransferConfig  # noqa: F401  (the executor reads kv_transfer_config)
    from vllm.v1.executor.abstract import Executor

    config = cache_config(extensible=True)
    workers = [worker(20 * GIB, config), worker(20 * GIB, config)]
    calls: list[str] = []

    def collective_rpc(method: str, *args, **kwargs):
        calls.append(method)
        return [getattr(each, method)() for each in workers]

    executor = types.SimpleNamespace(vllm_config=types.SimpleNamespace(cache_config=config, kv_transfer_config=None),
                                     collective_rpc=collective_rpc)
    reason = Executor.extensible_kv_cache_unsupported_reason(executor, [{"layer": object()}])
    assert reason == REASON
    Executor.disable_extensible_kv_cache(executor, reason)
    assert calls == ["extensible_kv_cache_unsupported_reason", "disable_extensible_kv_cache"]
    assert config.enable_extensible_kv_cache is False
    # Worker.disable_extensible_kv_cache recomputed the budget through request_memory, unrefused at 20 GiB free,
    # at the estimate-based share that now applies.
    share = config.resolved_gpu_memory_utilization
    assert share < 1.0 and [each.requested_memory for each in workers] == [math.ceil(TOTAL * share)] * 2


def test_unpatched_the_second_worker_is_refused_when_vllm_turns_its_cache_off():
    """What the patch changes: vLLM's own worker re-resolves the budget under the estimate rule and fails."""
    config = cache_config(extensible=True)
    made = worker(20 * GIB, config)
    with pytest.raises(ValueError, match="Free memory on device"):
        made.disable_extensible_kv_cache()


def test_reverting_gives_vllms_methods_back(patched):
    from vllm.v1.worker import gpu_worker, utils

    method = "extensible_kv_cache_unsupported_reason"
    assert gpu_worker.request_memory is not utils.request_memory
    assert hasattr(gpu_worker.Worker.__dict__[method], "__wrapped__")
    patched.revert()
    assert gpu_worker.request_memory is utils.request_memory
    assert not hasattr(gpu_worker.Worker.__dict__[method], "__wrapped__")


def test_the_blocks_warm_up_ensures_are_mapped_before_it_addresses_them():
    """vLLM 0.34's warm-ups ask ``ensure_kv_cache_blocks(runner, n)`` before using blocks ``[0, n)``: with
    vLLM's extensible cache off, the pool maps exactly the groups of those blocks, through every name
    the warm-ups call, and a release after revert maps nothing."""
    import importlib

    from kv_fixtures import build_cache
    from kvelastic.patches import warmup_blocks

    _, _, cache = build_cache(num_blocks=256)
    runtime = types.SimpleNamespace(cache=cache)
    runner = types.SimpleNamespace(extensible_kv_cache=None)  # vLLM's own cache off, as kvelastic has it
    patcher = Patcher(installed_vllm_version(), warmup_blocks.PATCH.targets)
    warmup_blocks.PATCH.apply(patcher, runtime)
    try:
        mapped = cache.pool.is_mapped
        assert [g for g in range(cache.num_groups) if mapped(g)] == [0]  # the null block's group alone
        warmup = importlib.import_module("vllm.v1.worker.gpu.warmup")
        warmup.ensure_kv_cache_blocks(runner, 1 + 2 * cache.blocks_per_group)  # the name warmup.py calls
        assert [g for g in range(cache.num_groups) if mapped(g)] == [0, 1, 2]
        defined = importlib.import_module("vllm.v1.worker.extensible_kv_cache")
        defined.ensure_kv_cache_blocks(runner, 10 ** 6)  # more than the cache has: all of it, no error
        assert all(mapped(g) for g in range(cache.num_groups))
    finally:
        patcher.revert()
    _, _, fresh = build_cache(num_blocks=256)
    runtime.cache = fresh
    warmup.ensure_kv_cache_blocks(runner, 256)  # vLLM's function again: nothing of kvelastic's runs
    assert [g for g in range(fresh.num_groups) if fresh.pool.is_mapped(g)] == [0]
