"""Two engines in one process sharing one account: grants, refusals as scheduling misses, limits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvelastic.cluster.source import SharedBudgetSource
from kvelastic.hooks.block_pool import make_page_aware
from kvelastic.scheduler.mapper import GroupMapper
from kvelastic.scheduler.cluster_link import ClusterLink, MemberTerms
from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.pool.kv_layout import KVGroupLayout, merge_runs, runs_of_view
from kvelastic.scheduler.upkeep import UpkeepThread, engine_upkeep
from kvelastic.pool import DeviceSource, HostBackend, LimitedSource, PagePool, ReserveSource
from tests.kv_fixtures import StandInRequest
from tests.scheduler_harness import scheduler_patcher

block_pool_module = pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")
N, ROW, PAGE = 256, 2048, 64 * 1024  # blocks, bytes per block per layer, page: 32 blocks


def engine(name: str, budget: int, limit: int | None):
    backend = HostBackend()
    gate = SharedBudgetSource(DeviceSource(backend, PAGE))
    pool = PagePool(backend, ReserveSource(LimitedSource(gate)), zero_on_map=False)
    raw = pool.add_tensor(N * ROW)
    region = pool.region_of(raw)
    view = raw.view(N, ROW)
    runs = runs_of_view(view.shape, view.stride(), 1, 0, N)
    cache = ElasticKVCache(pool, KVGroupLayout(merge_runs([(region.region_id, *runs)]), N, PAGE))
    bp = block_pool_module.BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=16)
    queue = make_page_aware(bp, cache, GroupMapper(cache), patcher=scheduler_patcher())
    link = ClusterLink(cache, gate, MemberTerms(name=name, model="dummy-model", shared_budget_bytes=budget), limit)
    return pool, raw, cache, bp, queue, link


def test_engines_share_one_budget_and_a_refusal_is_a_scheduling_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    a = engine("a", budget=8 * PAGE, limit=None)
    b = engine("b", budget=8 * PAGE, limit=None)
    try:
        got = a[3].get_new_blocks(4 * 32)  # groups 0-4 plus one mapped ahead: 6 of the 8 pages
        assert len(got) == 128
        free_b = b[3].get_num_free_blocks()
        assert free_b < 2 * 32  # b only sees what the account can still grant
        with pytest.raises(ValueError):
            b[3].get_new_blocks(free_b + 32)  # vLLM's own check refuses: a scheduling miss
        members = {m.name: m for m in a[5].account.members()}
        assert sum(m.mapped_bytes for m in members.values()) <= 8 * PAGE
        a[3].free_blocks(got)
        a[4].set_idle()
        a[0].collect()
        a[0].trim_reserve(0)  # the reclaimer does this when idle or under pressure
        b[2]._device_free_cache = (0.0, None)  # both estimates are cached briefly; skip the wait
        b[4].room.forget()
        assert b[3].get_num_free_blocks() >= 3 * 32  # a's memory flowed back to the account
    finally:
        for eng in (a, b):
            eng[5].leave()
            eng[0].close()


def test_an_engine_gives_its_cached_memory_back_when_another_waits_on_the_account(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    a = engine("a", budget=8 * PAGE, limit=None)
    b = engine("b", budget=8 * PAGE, limit=None)
    upkeep = _linked_reclaimer(a[4], a[2], a[5])
    try:
        blocks = a[3].get_new_blocks(4 * 32)
        a[3].cache_full_blocks(StandInRequest([b"a%d" % i for i in range(128)]), blocks, 0, 128, 16, 0)
        a[3].free_blocks(blocks)  # groups 1-4 hold only cached prefix blocks now
        upkeep.tick()  # nobody waits: a busy engine keeps its cache
        assert a[0].mapped_groups() >= {1, 2, 3, 4}
        assert a[5].member.info().mapped_bytes == 6 * PAGE and b[5].member.info().mapped_bytes == 2 * PAGE
        assert b[0].grow_reserve(1) == 0  # the account is full: it refuses b and records what b wanted
        upkeep.tick()  # pressure: a gives back its oldest cached group and the empty group mapped ahead
        assert a[0].mapped_groups() == {0, 2, 3, 4}
        assert a[5].member.info().mapped_bytes <= 5 * PAGE
        assert b[0].grow_reserve(1) == 1
    finally:
        for eng in (a, b):
            eng[5].leave()
            eng[0].close()


def test_limit_changed_in_the_account_reaches_the_pool(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pool, raw, cache, bp, queue, link = engine("solo", budget=64 * PAGE, limit=8 * PAGE)
    try:
        assert link.member.limits()[1] == 8 * PAGE
        link.account.set_limits("solo", max_bytes=3 * PAGE)
        reclaimer = _linked_reclaimer(queue, cache, link)
        reclaimer.tick()
        assert pool.stats().limit_bytes == 3 * PAGE
        assert bp.get_num_free_blocks() <= 3 * 32
    finally:
        link.leave()
        pool.close()


def test_clearing_the_cap_restores_the_start_up_cap_never_none(tmp_path, monkeypatch):
    """`kvelastic limit NAME none` (or any writer of max 0) puts back the cap the engine started with."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pool, _, cache, bp, queue, link = engine("solo", budget=64 * PAGE, limit=8 * PAGE)
    reclaimer = _linked_reclaimer(queue, cache, link)
    try:
        link.account.set_limits("solo", max_bytes=3 * PAGE)
        reclaimer.tick()
        assert pool.stats().limit_bytes == 3 * PAGE
        env = {**os.environ, "KVELASTIC_SHARED_DIR": str(tmp_path)}
        cli = subprocess.run([sys.executable, "-m", "kvelastic.cli", "limit", "solo", "none"], text=True,
                             capture_output=True, timeout=60, env=env)
        assert cli.returncode == 0, cli.stderr
        assert link.member.limits()[1] == 8 * PAGE
        reclaimer.tick()
        assert pool.stats().limit_bytes == 8 * PAGE
        link.account.set_limits("solo", max_bytes=0)  # a writer that clears the cap outright
        reclaimer.tick()
        assert pool.stats().limit_bytes == 8 * PAGE  # the pool keeps the start-up cap...
        assert link.member.limits()[1] == 8 * PAGE  # ...and the account shows it again
        assert bp.get_num_free_blocks() <= 8 * 32
    finally:
        link.leave()
        pool.close()


def test_an_engine_started_without_a_cap_stays_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pool, _, cache, _, queue, link = engine("free", budget=64 * PAGE, limit=None)
    reclaimer = _linked_reclaimer(queue, cache, link)
    try:
        link.account.set_limits("free", max_bytes=2 * PAGE)
        reclaimer.tick()
        assert pool.stats().limit_bytes == 2 * PAGE
        assert link.account.restore_max("free").max_bytes == 0
        reclaimer.tick()
        assert pool.stats().limit_bytes is None
    finally:
        link.leave()
        pool.close()


def test_showing_the_restored_cap_never_undoes_a_newer_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pool, *_, link = engine("late", budget=64 * PAGE, limit=8 * PAGE)
    try:
        link.account.set_limits("late", max_bytes=5 * PAGE)  # written after the engine read 0
        assert link.account.restore_max("late", only_if_cleared=True).max_bytes == 5 * PAGE
        link.account.set_limits("late", max_bytes=0)
        assert link.account.restore_max("late", only_if_cleared=True).max_bytes == 8 * PAGE
    finally:
        link.leave()
        pool.close()


def _linked_reclaimer(queue, cache, link) -> UpkeepThread:
    """The engine's upkeep, joined to the shared account through ``link``; ticked by the test."""
    return engine_upkeep(queue, cache, _NoLock(), cache_ttl_s=60.0, reserve_bytes=0, link=link)


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
