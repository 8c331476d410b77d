"""An engine whose KV cache lives in one worker rank joins that GPU's shared account.

A data-parallel engine core (and TP=1 through the multiprocess executor) runs
its one worker in a child process: the scheduler reaches the pool through the
rank protocol. Here vLLM's real scheduler drives a rank process (a
host-backed pool) and joins the account the rank's device names, so it shares
the device with a one-process engine (vLLM's real scheduler over a pool in the
test's process): both are members of one account, the rank engine's maps are
charged before they are sent, and together the two never hold more than the
budget. Every block the rank reads is checked to hold its tokens' data.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.cluster import SharedAccount  # noqa: E402
from kvelastic.cluster.device import device_identity  # noqa: E402
from kvelastic.pool.host import HostBackend  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from kvelastic.patches.executor_step_report import STEP_REPORT  # noqa: E402
from tests.kv_fixtures import GROUP_BYTES, NamedHostBackend  # noqa: E402
from tests.scheduler_harness import make_requests, model_output  # noqa: E402
from tests.test_real_scheduler import patched  # noqa: E402,F401 - the fixture
from tests.test_tp_real_scheduler import close_engines, engine_over, step_to_ranks  # noqa: E402
from tests.tp_ranks import RankProcesses  # noqa: E402

BUDGET_GROUPS = 6


@pytest.fixture
def rank_engine(patched, monkeypatch):  # noqa: F811 - patched sets KVELASTIC_SHARED_DIR first
    made: list = []

    def make(devices: tuple[str, ...] | None = None, **settings):
        """One rank on the host-memory device, or (``devices``) one rank on each device named."""
        world = len(devices) if devices else 1
        ranks = RankProcesses(layers=(3,) * world, devices=devices)
        made.append(ranks)
        scheduler, patcher = engine_over(ranks, Settings(enabled=True, **settings))
        made.append((scheduler, patcher))
        return scheduler, ranks

    yield make
    close_engines(made)


def _step_rank_engine(scheduler, ranks: RankProcesses) -> None:
    """One engine step: an empty one where nothing is scheduled (commands still go out with it), its ranks'
    reports on its output."""
    out = scheduler.schedule()
    carried = step_to_ranks(scheduler, ranks, out)
    samplers = {r for r in out.num_scheduled_tokens
                if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
    result = model_output(scheduler, out, samplers)
    if carried:
        STEP_REPORT.put(result, carried[STEP_REPORT.name])
    scheduler.update_from_output(out, result)


def _step_local(scheduler) -> None:
    if scheduler.has_requests():
        out = scheduler.schedule()
        samplers = {r for r in out.num_scheduled_tokens
                    if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
        scheduler.update_from_output(out, model_output(scheduler, out, samplers))


def _account() -> SharedAccount:
    gpu_id, _ = device_identity(HostBackend())
    return SharedAccount.open(gpu_id, BUDGET_GROUPS * GROUP_BYTES)


def test_a_one_rank_engine_joins_the_account_its_rank_names_and_is_charged_for_its_maps(rank_engine):
    scheduler, ranks = rank_engine(name="ranked", shared_budget_bytes=BUDGET_GROUPS * GROUP_BYTES)
    for request in make_requests("r", 6, 420, 0, seed=5, max_tokens=20):
        scheduler.add_request(request)
    account = _account()
    try:
        seen = []
        for _ in range(400):
            _step_rank_engine(scheduler, ranks)
            scheduler.kvelastic_reclaimer.tick()
            member = {m.name: m for m in account.members()}["ranked"]
            assert member.pid == os.getpid()
            seen.append((member.mapped_bytes, ranks.mapped_bytes[0]))
            if not scheduler.has_requests():
                break
        assert not scheduler.has_requests(), "the wave never finished"
        # the account is charged when a map is sent, before the rank maps: it never shows less than the rank holds
        assert all(charged >= held for charged, held in seen), seen
        assert max(held for _, held in seen) > 0
        assert max(charged for charged, _ in seen) <= BUDGET_GROUPS * GROUP_BYTES
    finally:
        account.close()


def test_a_one_rank_engine_and_a_local_engine_share_one_budget_and_both_finish(patched, rank_engine):  # noqa: F811
    shared = dict(shared_budget_bytes=BUDGET_GROUPS * GROUP_BYTES, cache_ttl_s=60.0, reserve_bytes=0)
    local, local_pool, _ = patched(name="local", shared=True, **shared)
    ranked, ranks = rank_engine(name="ranked", **shared)
    for request in make_requests("a", 8, 460, 0, seed=3, max_tokens=40):
        local.add_request(request)
    for request in make_requests("b", 4, 500, 0, seed=4, max_tokens=30):
        ranked.add_request(request)
    most_ranked = 0
    for step in range(800):
        _step_local(local)
        _step_rank_engine(ranked, ranks)
        local.kvelastic_reclaimer.tick()
        ranked.kvelastic_reclaimer.tick()
        together = local_pool.stats().held_bytes + ranks.mapped_bytes[0]
        assert together <= BUDGET_GROUPS * GROUP_BYTES, f"step {step}: {together} bytes held together"
        most_ranked = max(most_ranked, ranks.mapped_bytes[0])
        if not local.has_requests() and not ranked.has_requests():
            break
    assert not local.has_requests() and not ranked.has_requests(), "a wave never finished"
    assert most_ranked > 0


def test_a_tp_engine_joins_each_gpus_account_and_maps_only_what_the_fullest_grants(rank_engine):
    """Ranks on two GPUs: the engine is a member of both accounts; another engine holds part of the second
    GPU's budget, so the groups every rank maps stay within what is left there, and the wave still ends."""
    from tests.scheduler_harness import drive

    other_bytes = 2 * GROUP_BYTES
    gpu_b = SharedAccount.open(device_identity(NamedHostBackend("gpub"))[0], BUDGET_GROUPS * GROUP_BYTES)
    other = gpu_b.join("other")
    assert other.request(other_bytes).granted  # another engine's pages on the second GPU
    scheduler, ranks = rank_engine(devices=("gpua", "gpub"), name="tp", reserve_bytes=0,
                                   shared_budget_bytes=BUDGET_GROUPS * GROUP_BYTES)
    try:
        held: list[tuple[int, int]] = []

        def forward(s, out):
            return step_to_ranks(s, ranks, out)

        def after_step(_) -> None:
            scheduler.kvelastic_reclaimer.tick()
            held.append(tuple(ranks.mapped_bytes))

        drive(scheduler, [make_requests("t", 6, 420, 0, seed=6, max_tokens=20)], max_steps=3000,
              forward=forward, after_step=after_step)
        assert not scheduler.has_requests()
        room = BUDGET_GROUPS * GROUP_BYTES - other_bytes  # what the second GPU's account leaves it
        assert all(max(h) <= room for h in held), held  # every rank maps the same groups
        assert max(h1 for _, h1 in held) == room  # the wave needed more: the account's room was what held it
        for name in ("gpua", "gpub"):
            account = SharedAccount.open(device_identity(NamedHostBackend(name))[0], BUDGET_GROUPS * GROUP_BYTES)
            try:
                assert "tp" in {m.name for m in account.members()}, f"not a member on {name}"
            finally:
                account.close()
        # `kvelastic limit` (a real CLI process) caps the engine on every GPU it runs on: the pool follows
        cap = 8 * GROUP_BYTES  # the CLI takes no cap under 2 MiB (one chunk)
        done = subprocess.run([sys.executable, "-m", "kvelastic.cli", "limit", "tp", str(cap)], env=dict(os.environ),
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0 and done.stdout.count("tp on GPU") == 2, done.stdout + done.stderr
        scheduler.kvelastic_reclaimer.tick()
        assert scheduler.kv_cache_manager.block_pool.free_block_queue.cache.pool.limit_bytes == cap
    finally:
        gpu_b.close()
