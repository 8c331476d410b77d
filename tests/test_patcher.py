"""The Patcher: it touches only what the gate checked, and every change it makes comes undone.

Against the real installed vLLM: real ``BlockPool`` objects for the single
changes, and vLLM's real ``Scheduler`` attached (and failing to attach) over a
host-backed elastic cache, compared object by object with its state before.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")
wrapt = pytest.importorskip("wrapt")

from kvelastic.errors import PatchError  # noqa: E402
from kvelastic.startup.runtime import Runtime  # noqa: E402
from kvelastic.hooks.scheduler import attach_scheduler  # noqa: E402
from kvelastic.patches import admission_check, block_pool_queue, host_tier_lookup  # noqa: E402
from kvelastic.patching.apply import Patcher  # noqa: E402
from kvelastic.patching.spec import Absent, Signature, Target  # noqa: E402
from kvelastic.patching.versions import SUPPORTED, Version, installed_vllm_version  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from tests.contact_probe import instance_changes  # noqa: E402
from tests.kv_fixtures import BS, GROUP_BYTES, N, build_cache  # noqa: E402
from tests.scheduler_harness import make_scheduler, scheduler_patcher  # noqa: E402

VERSION = installed_vllm_version()


def block_pool():
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=BS)


def state(*objects) -> list[dict]:
    return [dict(vars(obj)) for obj in objects]


def same_state(before: list[dict], after: list[dict]) -> bool:
    """Same attributes bound to the very same objects (what "left exactly as it was" means)."""
    return all(a.keys() == b.keys() and all(a[k] is b[k] for k in a) for a, b in zip(before, after))


# ----------------------------------------------------------------------- what may be touched
def test_only_targets_the_gate_checked_in_their_declared_use_and_range_may_be_touched():
    bp = block_pool()
    only_usage = Patcher(VERSION, [block_pool_queue.GET_USAGE])
    with pytest.raises(PatchError, match="was not checked by the gate"):
        only_usage.wrap_instance(bp, block_pool_queue.RESET_PREFIX_CACHE, lambda w, i, a, k: w(*a, **k))
    with pytest.raises(PatchError, match="declared for use 'instance', not 'wrap'"):
        only_usage.wrap(block_pool_queue.GET_USAGE, lambda w, i, a, k: w(*a, **k))
    old = Patcher(Version(0, 12, 0), [block_pool_queue.EVICT_BLOCKS])
    assert not old.declares(block_pool_queue.EVICT_BLOCKS)  # a declared range, not a hasattr
    with pytest.raises(PatchError, match="declared absent in vLLM 0.12.0"):
        old.wrap_instance(bp, block_pool_queue.EVICT_BLOCKS, lambda w, i, a, k: w(*a, **k))
    with pytest.raises(PatchError, match="not among the attributes"):
        Patcher(VERSION, [block_pool_queue.BLOCK_POOL]).replace_attribute(bp, block_pool_queue.BLOCK_POOL,
                                                                          "enable_caching", False)
    with pytest.raises(PatchError, match="only new kvelastic_"):
        Patcher(VERSION, []).add_attribute(bp, "blocks", [])
    assert vars(bp).keys() == vars(block_pool()).keys()  # every refusal came before any change


def test_release_differences_are_read_off_the_declarations():
    estimate = admission_check.ESTIMATE
    assert Patcher(Version(0, 20, 1), [estimate]).params(estimate)[-1] == "num_tokens_main_model"
    assert Patcher(Version(0, 20, 2), [estimate]).params(estimate)[-1] == admission_check.FLAG
    flag_at = admission_check.flag_index(estimate.shape(VERSION).params)
    assert admission_check.is_admission_check(flag_at, (), {admission_check.FLAG: True})
    hashes = [host_tier_lookup.SET_BLOCK_HASH, host_tier_lookup.HASH_SETTER]
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    block = KVCacheBlock(block_id=3)
    host_tier_lookup.hash_assigner(Patcher(VERSION, hashes))(block, b"key")
    assert block.block_hash == b"key"
    with pytest.raises(LookupError, match="no way to set a block's hash"):
        host_tier_lookup.hash_assigner(Patcher(VERSION, []))


# ------------------------------------------------------------------------------ the changes
def test_instance_changes_apply_to_one_object_and_revert_restores_it_exactly():
    bp, other = block_pool(), block_pool()
    before = state(bp, other)
    patcher = scheduler_patcher()
    calls = []

    def usage(wrapped, instance, args, kwargs):
        calls.append(instance)
        return 0.5

    patcher.wrap_instance(bp, block_pool_queue.GET_USAGE, usage)
    queue = object()
    patcher.replace_attribute(bp, block_pool_queue.BLOCK_POOL, "free_block_queue", queue)
    patcher.add_attribute(bp, "kvelastic_queue", queue)
    assert bp.get_usage() == 0.5 and calls == [bp] and bp.free_block_queue is queue
    assert other.get_usage() == 0.0 and type(other).get_usage is vars(type(other))["get_usage"]
    assert patcher.wrapped == []  # no class- or module-level change
    patcher.revert()
    assert patcher.changes == ()
    assert same_state(before, state(bp, other))


def test_all_or_nothing_undoes_only_what_its_block_changed():
    bp = block_pool()
    patcher = scheduler_patcher()
    patcher.add_attribute(bp, "kvelastic_kept", 1)
    kept = state(bp)
    with pytest.raises(RuntimeError, match="late"):
        with patcher.all_or_nothing():
            patcher.wrap_instance(bp, block_pool_queue.GET_USAGE, lambda w, i, a, k: 1.0)
            patcher.add_attribute(bp, "kvelastic_queue", object())
            raise RuntimeError("late failure")
    assert same_state(kept, state(bp)) and bp.kvelastic_kept == 1
    assert [c.name for c in patcher.changes] == ["kvelastic_kept"]


def test_undo_of_a_change_with_another_stacked_on_it_is_refused():
    bp = block_pool()
    patcher = scheduler_patcher()
    first = patcher.wrap_instance(bp, block_pool_queue.GET_USAGE, lambda w, i, a, k: w(*a, **k) + 1)
    second = patcher.wrap_instance(bp, block_pool_queue.GET_USAGE, lambda w, i, a, k: w(*a, **k) + 10)
    assert bp.get_usage() == 11.0
    with pytest.raises(PatchError, match="stacked"):
        patcher.undo(first)
    patcher.undo(second)
    patcher.undo(first)
    assert "get_usage" not in vars(bp)


def test_declared_ranges_may_not_overlap_and_need_their_kind():
    with pytest.raises(ValueError, match="overlap"):
        Target("m", "f", (Signature(SUPPORTED, ()), Absent(SUPPORTED)))


# ------------------------------------------------------------------- attaching a scheduler
def scheduler_objects(scheduler):
    manager = scheduler.kv_cache_manager
    return (scheduler, manager, manager.coordinator, manager.block_pool, manager.block_pool.cached_block_hash_to_block)


def runtime_over(cache, **settings) -> Runtime:
    runtime = Runtime(Settings(enabled=True, **settings))
    runtime.cache = cache
    return runtime


def kvelastic_threads() -> int:
    return sum(t.name.startswith("kvelastic-") for t in threading.enumerate())


def test_a_failure_late_in_attaching_leaves_every_object_of_the_scheduler_as_vllm_made_it(monkeypatch, tmp_path):
    from kvelastic.scheduler.upkeep import UpkeepThread

    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pool, views, cache = build_cache(4)
    scheduler = make_scheduler()
    before = state(*scheduler_objects(scheduler))
    threads = kvelastic_threads()

    def fail(self):
        raise RuntimeError("the upkeep thread could not start")

    monkeypatch.setattr(UpkeepThread, "start", fail)
    patcher = scheduler_patcher()
    try:
        with pytest.raises(RuntimeError, match="could not start"):
            attach_scheduler(scheduler, runtime_over(cache, cpu_bytes=16 * GROUP_BYTES), patcher)
        assert patcher.changes == ()
        assert same_state(before, state(*scheduler_objects(scheduler)))
        assert kvelastic_threads() == threads  # the mapper started for it was stopped
    finally:
        pool.close()


@pytest.mark.parametrize("load", ["in-front", "beside"])
def test_attaching_changes_the_schedulers_objects_and_revert_puts_every_one_back(monkeypatch, tmp_path, load):
    from tests.host_plans import as_beside_a_connector

    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    if load == "in-front":  # the plan beside a vLLM connector
        as_beside_a_connector(monkeypatch)
    pool, views, cache = build_cache(4)
    scheduler = make_scheduler()
    objects = scheduler_objects(scheduler)
    before = state(*objects)
    patcher = scheduler_patcher()
    # host hits loaded in front of the step: the lookup hook on vLLM's prefix map; loads beside compute add
    # a connector, and keep the hook for a request alone
    reclaimer = attach_scheduler(scheduler, runtime_over(cache, cpu_bytes=16 * GROUP_BYTES), patcher)
    try:
        unchanged = [type(o).__name__ for b, o in zip(before, objects) if same_state([b], state(o))]
        assert unchanged == ["KVCacheManager"]  # only read: the others each carry a change
        changed = {(type(c.owner).__name__, c.name) for c in patcher.changes}
        assert {("Scheduler", "schedule"), ("Scheduler", "kvelastic_reclaimer"), ("BlockPool", "free_block_queue"),
                ("BlockHashToBlockMap", "get_one_block")} <= changed
        assert (("Scheduler", "connector") in changed) == (load == "beside")
        assert len(instance_changes(scheduler)) >= 8  # what the refusal probe looks for is visible here
    finally:
        reclaimer.stop()
        scheduler.kv_cache_manager.block_pool.free_block_queue.mapper.stop()
        patcher.revert()
        pool.close()
    assert same_state(before, state(*objects))
    assert instance_changes(scheduler) == []


def test_the_lookup_hook_follows_the_prefix_map_through_resets_without_piling_up(monkeypatch, tmp_path):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pool, views, cache = build_cache(4)
    scheduler = make_scheduler()
    patcher = scheduler_patcher()
    reclaimer = attach_scheduler(scheduler, runtime_over(cache, cpu_bytes=16 * GROUP_BYTES), patcher)
    block_pool = scheduler.kv_cache_manager.block_pool
    try:
        for _ in range(3):
            old_map = block_pool.cached_block_hash_to_block
            assert scheduler.reset_prefix_cache()
            if block_pool.cached_block_hash_to_block is not old_map:  # up to 0.33 vLLM makes a new map
                assert "get_one_block" not in vars(old_map)
            # (0.34 clears the map in place: the hook is put back on it, once)
            hook = vars(block_pool.cached_block_hash_to_block)["get_one_block"]
            assert isinstance(hook, wrapt.FunctionWrapper) and not isinstance(hook.__wrapped__, wrapt.FunctionWrapper)
        assert sum(c.name == "get_one_block" for c in patcher.changes) == 1
    finally:
        reclaimer.stop()
        block_pool.free_block_queue.mapper.stop()
        patcher.revert()
        pool.close()
