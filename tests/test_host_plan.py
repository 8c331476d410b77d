"""The host tier runs one plan, chosen from where the engine's KV cache lives (``kvelastic/offload/plan.py``).

Each situation an engine can be in (its cache in the scheduler's process or on
worker ranks; the ranks reporting their loads on the steps' replies or not; a
vLLM KV connector present or not) gives one plan, and the plan is what the
scheduler's attach wires: the same choices the defaults made before any of
them stopped being a setting.
"""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest

from kvelastic.offload.plan import HostPlan, host_plan

#: (cache in process, loads reported, vLLM connector) -> (write-through, stores beside, loads beside compute,
#: staged loads, load pieces)
SITUATIONS = [
    ((True, True, None), (True, True, True, True, True)),  # one GPU, uniprocess executor
    ((True, True, "LMCacheConnectorV1"), (True, True, False, True, True)),  # beside a vLLM connector
    ((False, True, None), (False, False, True, False, False)),  # TP/PP ranks reporting on the steps' replies
    ((False, False, None), (False, False, False, False, False)),  # ranks that report nothing on the replies
    ((False, True, "NixlConnector"), (False, False, False, False, False)),  # ranks beside a vLLM connector
]


@pytest.mark.parametrize("facts, choices", SITUATIONS,
                         ids=["in-process", "in-process-connector", "ranks", "ranks-silent", "ranks-connector"])
def test_each_situation_has_its_one_plan(facts, choices):
    in_process, reported, connector = facts
    plan = host_plan(cache_in_process=in_process, loads_reported=reported, vllm_connector=connector)
    assert (plan.write_through, plan.stores_beside, plan.loads_beside_compute, plan.staged_loads,
            plan.load_pieces) == choices
    assert plan.cache_in_process == in_process
    assert (plan.loads_in_front_because is None) == plan.loads_beside_compute


def test_a_plan_says_why_hits_load_in_front_of_the_step():
    beside = host_plan(cache_in_process=True, loads_reported=True, vllm_connector="LMCacheConnectorV1")
    assert beside.loads_in_front_because == ("vLLM's KV connector LMCacheConnectorV1 holds the seam that loads "
                                             "beside compute ride")
    silent = host_plan(cache_in_process=False, loads_reported=False, vllm_connector=None)
    assert silent.loads_in_front_because == "the worker ranks do not report loads on the steps' replies"


def test_a_plan_is_fixed_once_made():
    plan = host_plan(cache_in_process=True, loads_reported=True, vllm_connector=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.write_through = False  # type: ignore[misc]


@pytest.mark.parametrize("facts, line", [
    ((True, True, None), "KV cache in this process; blocks stored once computed, on a stream and staging buffer "
                         "of their own; hits load while their request waits, through a staging buffer of their "
                         "own (in front of the step when it is alone); long runs load a page group at a time"),
    ((False, True, None), "KV cache on worker ranks; blocks stored as they leave the GPU; hits load while their "
                          "request waits (in front of the step when it is alone)"),
    ((False, False, None), "KV cache on worker ranks; blocks stored as they leave the GPU; hits load in front of "
                           "the step (the worker ranks do not report loads on the steps' replies)"),
])
def test_the_plan_reads_as_one_line(facts, line):
    in_process, reported, connector = facts
    plan = host_plan(cache_in_process=in_process, loads_reported=reported, vllm_connector=connector)
    assert plan.describe() == line and "\n" not in line


def test_the_scheduler_plans_from_its_connection_and_its_connector_and_logs_the_plan_once(kv_log):
    """What ``attach_scheduler`` reads: where the connection has the cache, whether its loads are reported,
    and the class of the connector vLLM made; the plan is one info line."""
    from kvelastic.hooks.local_connection import LocalConnection
    from kvelastic.hooks.scheduler import _host_plan

    class SomeConnector:
        pass

    ranks = types.SimpleNamespace(unmaps_between_steps=False, async_loads=True)
    local = _host_plan(types.SimpleNamespace(connector=None), LocalConnection)  # its class attributes
    beside = _host_plan(types.SimpleNamespace(connector=SomeConnector()), LocalConnection)
    on_ranks = _host_plan(types.SimpleNamespace(connector=None), ranks)
    assert local == host_plan(cache_in_process=True, loads_reported=True, vllm_connector=None)
    assert beside == host_plan(cache_in_process=True, loads_reported=True, vllm_connector="SomeConnector")
    assert on_ranks == host_plan(cache_in_process=False, loads_reported=True, vllm_connector=None)
    records = list({id(r): r for r in kv_log.records}.values())  # a record reaches the capture by two loggers
    assert [r.getMessage() for r in records] == [f"kvelastic: host tier: {p.describe()}"
                                                 for p in (local, beside, on_ranks)]
    assert all(r.levelno == logging.INFO for r in records)


def test_an_engine_attached_in_process_runs_its_plan(tmp_path, monkeypatch, kv_log):
    """The real attach over vLLM's scheduler: write-through beside the copy stream, kvelastic's connector for
    the loads beside compute, the lookup hook for a request alone, the staging buffers, and one plan line;
    no line about a setting without effect."""
    pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")
    from kvelastic.hooks.scheduler import attach_scheduler
    from kvelastic.offload.side_stores import SideStoreCopier
    from tests.kv_fixtures import GROUP_BYTES
    from tests.scheduler_harness import make_scheduler, scheduler_patcher
    from tests.test_patcher import build_cache, runtime_over

    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pool, views, cache = build_cache(4)
    scheduler = make_scheduler()
    patcher = scheduler_patcher()
    reclaimer = attach_scheduler(scheduler, runtime_over(cache, cpu_bytes=16 * GROUP_BYTES), patcher)
    try:
        offload = scheduler.kvelastic_offload
        assert offload.write_through is not None and offload.write_through.beside
        assert isinstance(offload.copier, SideStoreCopier)
        copier = offload.copier.inner
        assert copier._side_mover is not None and copier._async_load_mover is not None
        assert type(scheduler.connector).__name__ == "HostLoads"
        assert offload.tier.ahead_slots == offload.tier.slots // 4
        records = {id(r): r for r in kv_log.records}.values()  # a record reaches the capture by two loggers
        plan_lines = [r.getMessage() for r in records if r.getMessage().startswith("kvelastic: host tier: ")]
        assert plan_lines == ["kvelastic: host tier: " + HostPlan(
            cache_in_process=True, write_through=True, stores_beside=True, loads_beside_compute=True,
            staged_loads=True, load_pieces=True).describe()]
        assert not [r for r in kv_log.records if "no effect" in r.getMessage()]
    finally:
        reclaimer.stop()
        scheduler.kv_cache_manager.block_pool.free_block_queue.mapper.stop()
        patcher.revert()
        pool.close()
