"""Two of vLLM's real schedulers sharing one account: the fair share end to end, on the CPU.

Engine ``a`` fills the shared budget with a long wave; then engine ``b`` gets a
wave of its own. Nothing of ``b``'s would ever fit while ``a`` holds the budget:
``b``'s scheduler asks for no pages, it only finds too few free blocks. Its
estimate records a want, ``a``'s upkeep reads the cap, ``a`` stops offering the
blocks it holds above its share and vLLM preempts what does not fit, the groups
``a`` leaves go back to the account, and ``b`` maps them. Both waves finish,
and the two engines never hold more than the budget together.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from tests.kv_fixtures import GROUP_BYTES  # noqa: E402
from tests.scheduler_harness import make_requests, model_output  # noqa: E402
from tests.test_real_scheduler import patched  # noqa: E402,F401 - the fixture

BUDGET_GROUPS = 6


def _step(scheduler) -> set[str]:
    """One scheduling step and its stand-in model output; the requests that got tokens."""
    if not scheduler.has_requests():
        return set()
    out = scheduler.schedule()
    samplers = {r for r in out.num_scheduled_tokens
                if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
    scheduler.update_from_output(out, model_output(scheduler, out, samplers))
    return set(out.num_scheduled_tokens)


def test_a_busy_engine_gives_a_newly_busy_one_its_share_before_its_own_wave_ends(patched):  # noqa: F811
    settings = dict(shared=True, shared_budget_bytes=BUDGET_GROUPS * GROUP_BYTES, cache_ttl_s=60.0,
                    reserve_bytes=0)
    a, a_pool, _ = patched(name="a", **settings)
    b, b_pool, _ = patched(name="b", **settings)
    a_wave = make_requests("a", 8, 460, 0, seed=3, max_tokens=60)
    b_wave = make_requests("b", 4, 500, 0, seed=4, max_tokens=40)  # needs more than the 2 groups b holds
    for request in a_wave:
        a.add_request(request)
    for _ in range(40):  # a alone: it takes the whole budget
        _step(a)
        a.kvelastic_reclaimer.tick()
        if a_pool.stats().held_bytes + b_pool.stats().held_bytes >= BUDGET_GROUPS * GROUP_BYTES:
            break
    assert a_pool.stats().held_bytes + b_pool.stats().held_bytes == BUDGET_GROUPS * GROUP_BYTES
    assert a_pool.stats().held_bytes > BUDGET_GROUPS // 2 * GROUP_BYTES  # more than its share of two
    for request in b_wave:
        b.add_request(request)
    b_done = a_done = None
    b_most = 0  # the most b held while a's wave ran
    for step in range(600):
        _step(b)
        if b_done is None and not b.has_requests():
            b_done = step
        _step(a)
        a.kvelastic_reclaimer.tick()
        b.kvelastic_reclaimer.tick()
        held = a_pool.stats().held_bytes + b_pool.stats().held_bytes
        assert held <= BUDGET_GROUPS * GROUP_BYTES, f"step {step}: the engines hold {held} bytes together"
        if a_done is None:
            b_most = max(b_most, b_pool.stats().held_bytes)
            if not a.has_requests():
                a_done = step
        if a_done is not None and b_done is not None:
            break
    print(f"b done at step {b_done}, a at {a_done}; b held at most {b_most / GROUP_BYTES} groups meanwhile")
    assert b_done is not None and a_done is not None, "a wave never finished"
    assert b_most >= BUDGET_GROUPS // 2 * GROUP_BYTES, "b never had its share while a's wave ran"
    assert b_done < a_done, f"b waited for a's wave (b done at step {b_done}, a at {a_done})"


def test_three_engines_turning_busy_in_turn_all_finish_within_the_budget(patched):  # noqa: F811
    """Staggered waves, as the GPU benchmark's bursts: nobody deadlocks on the shares, nothing passes the
    budget, and each newcomer holds its share (a third of the budget) while an earlier wave still runs."""
    budget_groups = 9
    settings = dict(shared=True, shared_budget_bytes=budget_groups * GROUP_BYTES, cache_ttl_s=60.0,
                    reserve_bytes=0)
    engines = [patched(name=name, **settings) for name in "abc"]
    waves = [make_requests(name, 6, 480, 0, seed=10 + i, max_tokens=50) for i, name in enumerate("abc")]
    got_share = [False, False, False]
    for step in range(900):
        for i, (scheduler, _, _) in enumerate(engines):
            if step == 25 * i:
                for request in waves[i]:
                    scheduler.add_request(request)
            _step(scheduler)
        for scheduler, _, _ in engines:
            scheduler.kvelastic_reclaimer.tick()
        held = [pool.stats().held_bytes for _, pool, _ in engines]
        assert sum(held) <= budget_groups * GROUP_BYTES, f"step {step}: {held}"
        running = [scheduler.has_requests() for scheduler, _, _ in engines]
        for i in range(3):
            others_busy = any(running[j] for j in range(3) if j != i)
            if running[i] and others_busy and held[i] >= budget_groups // 3 * GROUP_BYTES:
                got_share[i] = True
        if step > 50 and not any(running):
            break
    assert not any(scheduler.has_requests() for scheduler, _, _ in engines), "a wave never finished"
    assert got_share == [True, True, True], f"who held a third of the budget beside a busy other: {got_share}"
