"""The host tier's plans for the situations an engine meets, as the tests wire them."""

from __future__ import annotations

from kvelastic.offload.plan import host_plan

#: The KV cache in the scheduler's process, no vLLM connector: write-through beside, loads beside compute.
IN_PROCESS = host_plan(cache_in_process=True, loads_reported=True, vllm_connector=None)
#: The KV cache in the scheduler's process beside a vLLM KV connector: hits load in front of the step.
BESIDE_A_CONNECTOR = host_plan(cache_in_process=True, loads_reported=True, vllm_connector="AConnector")
#: The KV cache on worker ranks that report their loads on the steps' replies: stores at eviction.
ON_RANKS = host_plan(cache_in_process=False, loads_reported=True, vllm_connector=None)


def as_beside_a_connector(monkeypatch) -> None:
    """Engines attached from now on plan their host tier as beside a vLLM KV connector (hits load in front
    of the step), the connector itself left out: the patch's wiring of that situation, without one."""
    from kvelastic.hooks import scheduler as hooks_scheduler

    def planned(**facts):
        return host_plan(**{**facts, "vllm_connector": "AConnector"})

    monkeypatch.setattr(hooks_scheduler, "host_plan", planned)
