"""vLLM's real Scheduler, patched by ``scheduler_block_pool``, driven step by step on the CPU.

The same request stream goes through a vanilla scheduler and a patched one over
a host-backed elastic cache (``tests/scheduler_harness.py`` drives both), and
the steps, the invariants and the host tier's round trips are checked.
"""

from __future__ import annotations

import math
import types

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.cluster.source import SharedBudgetSource  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from tests.host_plans import as_beside_a_connector  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP, GROUP_BYTES, N, build_cache  # noqa: E402
from tests.scheduler_harness import (check_every_step, drive, drive_async, make_requests, make_scheduler,  # noqa: E402
                                     model_output, prefill, repeat_waves, wait_unmapped)
from tests.scheduler_harness import PatchedSchedulers, cached_blocks_are_all_mapped  # noqa: E402

@pytest.fixture
def patched(tmp_path, monkeypatch):
    """A scheduler factory whose schedulers are patched over a host-backed cache; torn down after the test."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    schedulers = PatchedSchedulers()

    def make(limit_groups: int | None = None, asynchronous: bool = False, shared: bool = False, **settings):
        gates: list = []
        gate = (lambda device: gates.append(SharedBudgetSource(device)) or gates[0]) if shared else None
        pool, views, cache = build_cache(limit_groups, wrap_device=gate)
        if shared:  # the engine joins the GPU's shared account, as it does when vLLM runs it
            settings = {"name": "engine", "shared_budget_bytes": 64 * GROUP_BYTES, **settings}
        scheduler = schedulers.make(pool, views, cache, Settings(
            enabled=True, limit_bytes=limit_groups and limit_groups * GROUP_BYTES, **settings), asynchronous,
            budget_source=gates[0] if shared else None)
        return scheduler, pool, views

    yield make
    schedulers.close()


def test_with_memory_to_spare_the_patched_scheduler_makes_vanillas_decisions(patched):
    vanilla = drive(make_scheduler(), repeat_waves())
    scheduler, _, _ = patched(cache_ttl_s=math.inf)  # nothing idles out: the comparison has no clock in it
    assert type(scheduler.kv_cache_manager.block_pool.free_block_queue).__name__ == "PageAwareFreeQueue"
    assert drive(scheduler, repeat_waves()) == vanilla
    assert prefill(vanilla, "b") < prefill(vanilla, "a") / 10  # the second wave hit the cache


def test_without_a_connector_no_free_order_is_kept_and_reading_it_says_why(patched):
    from kvelastic.scheduler.free_order import FreeOrderNotKept

    scheduler, _, _ = patched()
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    drive(scheduler, repeat_waves()[:1])
    for read in (lambda: queue.fake_free_list_head, lambda: list(queue.iter_blocks_after(None))):
        with pytest.raises(FreeOrderNotKept, match="only for an engine with a KV connector"):
            read()
    # with a connector the order is kept: tests/test_connector_scheduler.py drives SimpleCPUOffload's lazy walk


def test_under_a_tight_limit_every_request_finishes_within_it(patched):
    scheduler, pool, _ = patched(limit_groups=2)  # 64 blocks; one wave needs about 80 at once
    mapped = []
    trace = drive(scheduler, repeat_waves(), after_step=check_every_step(pool, mapped))
    expected = {f"{w}-{i}" for w in "ab" for i in range(6)} | {f"c-{i}" for i in range(8)}
    assert {rid for step in trace for rid, _ in step} == expected
    assert not scheduler.has_requests()
    assert max(mapped) <= 2 * GROUP_BYTES < N // BLOCKS_PER_GROUP * GROUP_BYTES


@pytest.mark.parametrize("cpu", [False, True, "async"], ids=["no-host-tier", "host-tier", "host-tier-async-loads"])
def test_a_prefix_pushed_out_by_other_work_comes_back_from_the_host_tier(patched, monkeypatch, cpu):
    """a, then unrelated work that evicts a's blocks, then a's prompts again (loaded in front of the step,
    as the plan has them beside a vLLM connector, or while b's requests wait, through kvelastic's connector:
    the plan in a process that holds its cache)."""
    settings = {"cpu_bytes": 16 * GROUP_BYTES} if cpu else {}  # room for every block the test caches
    if cpu is True:
        as_beside_a_connector(monkeypatch)
    scheduler, pool, _ = patched(limit_groups=3, **settings)
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
    trace = drive(scheduler, [make_requests("a", 4, 320, 320, seed=0), *filler, make_requests("b", 4, 320, 320, seed=0)],
                   after_step=check_every_step(pool))
    offload = getattr(scheduler, "kvelastic_offload", None)
    if cpu:
        stats = offload.stats()
        assert offload.tier.hits >= 19 and stats["reloaded_bytes"] >= 19 * offload.copier.bytes_per_block
        assert prefill(trace, "b") < prefill(trace, "a") / 4
        assert (stats.get("host_loads_async", 0) >= 1) == (cpu == "async")
        assert (stats.get("host_async_loaded_blocks", 0) >= 19) == (cpu == "async")
        assert (type(scheduler.connector).__name__ == "HostLoads") == (cpu == "async")
    else:
        assert offload is None
        assert prefill(trace, "b") >= prefill(trace, "a") * 0.9  # recomputed


def test_a_prefix_cache_reset_forgets_gpu_and_host_copies(patched):
    scheduler, _, _ = patched(limit_groups=3, cpu_bytes=16 * GROUP_BYTES)
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]  # pushes a's blocks to the host
    trace = drive(scheduler, [make_requests("a", 4, 320, 320, seed=0), *filler])
    held = scheduler.kv_cache_manager.block_pool.get_new_blocks(1)  # a block in use: vLLM declines to reset
    cached = len(scheduler.kvelastic_offload.tier._slot_of)
    assert cached and not scheduler.reset_prefix_cache()
    assert len(scheduler.kvelastic_offload.tier._slot_of) == cached, "host copies dropped by a reset vLLM declined"
    scheduler.kv_cache_manager.block_pool.free_blocks(held)
    assert scheduler.reset_prefix_cache()
    assert len(scheduler.kvelastic_offload.tier._slot_of) == 0
    trace += drive(scheduler, [make_requests("b", 4, 320, 320, seed=0)])
    assert prefill(trace, "b") == prefill(trace, "a")  # recomputed in full, as vanilla would
    trace += drive(scheduler, [make_requests("c", 4, 320, 320, seed=0)])
    assert prefill(trace, "c") < prefill(trace, "b") / 4  # the lookup hook survived the reset


def test_aborted_requests_give_their_blocks_back(patched):
    from vllm.v1.request import RequestStatus

    scheduler, pool, _ = patched()
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    for request in make_requests("a", 6, 460, 0, seed=3):
        scheduler.add_request(request)
    for _ in range(3):
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_output(scheduler, out, set()))
    assert queue.num_in_use > 1
    scheduler.finish_requests([f"a-{i}" for i in range(6)], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert queue.num_in_use == 1  # vLLM's null block only


@pytest.mark.parametrize("cpu", [False, True], ids=["no-host-tier", "host-tier"])
def test_an_idle_engine_gives_memory_back_and_keeps_its_prefix_on_the_host(patched, cpu):
    settings = {"cpu_bytes": 16 * GROUP_BYTES} if cpu else {}
    scheduler, pool, _ = patched(cache_ttl_s=0.0, reserve_bytes=0, **settings)
    trace = drive(scheduler, [make_requests("a", 4, 320, 0, seed=0)])  # 80 prompt blocks: three groups
    busy = pool.stats().mapped_bytes
    scheduler.kv_cache_manager.block_pool.free_block_queue.last_allocation -= 2  # as if the engine had idled for 2 s
    scheduler.kvelastic_reclaimer.tick()
    idle = wait_unmapped(pool, GROUP_BYTES)
    assert idle <= GROUP_BYTES < busy  # only the group holding vLLM's null block stays
    assert cached_blocks_are_all_mapped(scheduler, pool)
    trace += drive(scheduler, [make_requests("b", 4, 320, 0, seed=0)], after_step=check_every_step(pool))
    if cpu:
        assert scheduler.kvelastic_offload.tier.hits >= 40
        assert prefill(trace, "b") < prefill(trace, "a") / 4
    else:
        assert prefill(trace, "b") > prefill(trace, "a") / 2  # most of the prefix died with its memory


def test_a_limit_lowered_mid_run_is_honoured_without_losing_a_request(patched):
    """As ``kvelastic limit NAME 1GiB`` does to a busy engine: running requests finish, memory comes down."""
    scheduler, pool, _ = patched(cache_ttl_s=0.0, reserve_bytes=0)
    steps = []

    def lower_the_limit(s) -> None:
        steps.append(pool.stats().mapped_bytes)
        if len(steps) == 6:
            pool.set_limit(2 * GROUP_BYTES)
        if len(steps) >= 6:  # the upkeep between steps, on each one: no dependence on its thread's timing
            s.kvelastic_reclaimer.tick()
        check_every_step(pool)(s)

    trace = drive(scheduler, [make_requests("c", 8, 460, 0, seed=1)], after_step=lower_the_limit)
    assert max(steps[:6]) > 2 * GROUP_BYTES  # the wave had more than the new limit before it came
    assert {rid for step in trace for rid, _ in step} == {f"c-{i}" for i in range(8)}
    scheduler.kv_cache_manager.block_pool.free_block_queue.last_allocation -= 2
    scheduler.kvelastic_reclaimer.tick()
    assert wait_unmapped(pool, 2 * GROUP_BYTES) <= 2 * GROUP_BYTES


def test_a_lowered_limit_is_reached_while_requests_still_run(patched):
    """What a fair-share cap does to a busy engine: it stops offering the memory its requests hold over
    the limit, so vLLM admits less and preempts what does not fit; memory comes down before the wave ends,
    and every request still finishes."""
    scheduler, pool, _ = patched(cache_ttl_s=0.0, reserve_bytes=0)
    groups = []

    def lower_the_limit_and_tick(s) -> None:
        groups.append(pool.stats().mapped_bytes // GROUP_BYTES)
        if len(groups) == 6:
            pool.set_limit(2 * GROUP_BYTES)
        if len(groups) >= 6:
            s.kvelastic_reclaimer.tick()
        check_every_step(pool)(s)

    trace = drive(scheduler, [make_requests("c", 8, 460, 0, seed=1)], after_step=lower_the_limit_and_tick)
    assert max(groups[:6]) > 2  # the wave held more than the new limit before it came
    assert 2 in groups[6:-1]  # within the limit while requests still ran
    assert {rid for step in trace for rid, _ in step} == {f"c-{i}" for i in range(8)}


def test_async_scheduling_makes_vanillas_decisions_and_keeps_the_invariants(patched):
    """The AsyncScheduler (one step in flight, as vLLM's async scheduling runs it) is patched too."""
    vanilla = drive_async(make_scheduler(asynchronous=True), repeat_waves())
    scheduler, pool, _ = patched(asynchronous=True, cache_ttl_s=math.inf)  # as above: no clock in the comparison
    assert type(scheduler).__name__ == "AsyncScheduler"
    assert drive_async(scheduler, repeat_waves(), after_step=check_every_step(pool)) == vanilla
    assert prefill(vanilla, "b") < prefill(vanilla, "a") / 10


@pytest.mark.parametrize("load", ["in-front", "beside"])
def test_async_scheduling_under_a_tight_limit_with_the_host_tier(patched, monkeypatch, load):
    """Step N+1 scheduled before step N's output arrives (vLLM's default from 0.14), with host hits loaded
    in front of the step (the plan beside a vLLM connector) or while their request waits."""
    if load == "in-front":
        as_beside_a_connector(monkeypatch)
    scheduler, pool, _ = patched(limit_groups=3, asynchronous=True, cpu_bytes=16 * GROUP_BYTES)
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
    trace = drive_async(scheduler, [make_requests("a", 4, 320, 320, seed=0), *filler,
                                     make_requests("b", 4, 320, 320, seed=0)], after_step=check_every_step(pool))
    assert scheduler.kvelastic_offload.tier.hits >= 19
    assert prefill(trace, "b") < prefill(trace, "a") / 4


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_the_invariants_and_finish(patched, seed):
    """Random prompts, shared prefixes, limits, host tier on or off, sync or async scheduling; half the
    engines share a GPU account that disappears mid-run (removed, zeroed, or the engine's record freed)."""
    import random

    rng = random.Random(seed)
    asynchronous = rng.random() < 0.5
    cpu = {"cpu_bytes": rng.choice([2, 16]) * GROUP_BYTES} if rng.random() < 0.6 else {}
    lose = AccountLoss(seed, random.Random(1000 + seed))  # its own draws: the workloads stay what they were
    scheduler, pool, _ = patched(limit_groups=rng.choice([2, 3, 5, None]), asynchronous=asynchronous,
                                 cache_ttl_s=rng.choice([0.0, 10.0]), shared=lose.shared, **cpu)
    waves, expected = [], set()
    for w in range(rng.randint(2, 5)):
        count, length = rng.randint(1, 8), rng.randint(20, 700)
        wave = make_requests(f"w{w}", count, length, rng.randint(0, length), seed=rng.randrange(4),
                         max_tokens=rng.randint(1, 40))
        waves.append(wave)
        expected |= {r.request_id for r in wave}
    checks = check_every_step(pool)

    def step(s) -> None:
        checks(s)
        lose.maybe(s.kvelastic_reclaimer)
        if rng.random() < 0.05:  # now and then the engine idles long enough for the reclaimer
            s.kv_cache_manager.block_pool.free_block_queue.last_allocation -= 20
            s.kvelastic_reclaimer.tick()

    trace = (drive_async if asynchronous else drive)(scheduler, waves, after_step=step)
    assert {rid for s in trace for rid, _ in s} == expected
    assert not scheduler.has_unfinished_requests()
    lose.check_rejoined(scheduler.kvelastic_reclaimer)


class AccountLoss:
    """Takes the shared account away from an engine once, at a random early step, as a user or a crash would.

    Odd seeds share an account; seeds 1, 3 and 5 lose it each in one of the three ways.
    """

    WAYS = ("file removed", "header zeroed", "record freed")

    def __init__(self, seed: int, rng) -> None:
        self.shared = seed % 2 == 1
        self.way = self.WAYS[seed // 2 % len(self.WAYS)]
        self.at_step = rng.randint(1, 5)
        self.steps = 0
        self.done = False

    def maybe(self, upkeep) -> None:
        self.steps += 1
        if not self.shared or self.done or self.steps < self.at_step:
            return
        link = _link_of(upkeep)
        from kvelastic.cluster import SharedAccount
        from kvelastic.cluster.records import MemberRecord

        self.done = True
        link.membership.rejoin_period_s = 0.0
        path = link.account.path
        if self.way == "file removed":
            path.unlink()
        elif self.way == "header zeroed":
            with open(path, "r+b") as handle:
                handle.write(bytes(512))
        else:
            with SharedAccount.attach(path) as account, account._file.transaction() as snap:
                snap.write(MemberRecord(slot=snap.by_name(link.name).slot))

    def check_rejoined(self, reclaimer) -> None:
        """After the run the engine is a member again and the account shows what it really holds."""
        if not self.shared:
            return
        link = _link_of(reclaimer)
        assert self.done, "the run ended before the account was taken away"
        if self.way == "header zeroed" and link.account is not None:
            link.headroom()  # notices the corrupt header now if no step has asked since
        if self.way == "header zeroed":
            assert not link.membership.attached
            (link.account.path if link.account else _account_file(link)).unlink()  # `kvelastic reset`
        reclaimer.tick()
        reclaimer.tick()
        assert link.membership.attached
        (member,) = [m for m in link.account.members() if m.name == link.name]
        assert member.mapped_bytes == link.source.outstanding_bytes


def _link_of(upkeep):
    """The engine's ClusterLink, held by its upkeep's account job."""
    return next(job.link for job in upkeep.jobs if hasattr(job, "link"))


def _account_file(link):
    from kvelastic.cluster import account_path

    return account_path(link.gpu_id)


@pytest.mark.parametrize("seed", range(4))
def test_a_reclaimer_ticking_constantly_beside_the_scheduler_breaks_nothing(patched, seed):
    """The reclaimer thread releases idle cached groups while steps run (TTL 0, a tick every millisecond)."""
    import random
    import time

    rng = random.Random(100 + seed)
    asynchronous = seed % 2 == 1
    # a warm reserve of two groups: a tick that grows 256 MiB of host pages in turns beside the steps lasts
    # about as long as the drive, and this test is about many ticks
    scheduler, pool, _ = patched(limit_groups=rng.choice([3, None]), asynchronous=asynchronous, cache_ttl_s=0.0,
                                 cpu_bytes=16 * GROUP_BYTES, reserve_bytes=2 * GROUP_BYTES)
    reclaimer = scheduler.kvelastic_reclaimer
    reclaimer.stop()
    ticks = []
    original_tick = reclaimer.tick
    reclaimer.tick = lambda: (ticks.append(1), original_tick())  # type: ignore[method-assign]
    reclaimer.interval_s = 0.001
    reclaimer._stop.clear()
    reclaimer.start()
    checks = check_every_step(pool)
    steps = []

    def step(s) -> None:
        checks(s)  # under the reclaimer's lock (scheduler_harness.scheduler_lock): a settled state
        steps.append(1)
        if len(steps) % 10 == 0:
            time.sleep(0.002)  # let the reclaimer in between steps, not only at the interpreter's switches

    waves = [make_requests(f"w{w}", rng.randint(2, 6), rng.randint(50, 600), rng.randint(0, 50),
                           seed=rng.randrange(2)) for w in range(4)]
    trace = (drive_async if asynchronous else drive)(scheduler, waves, after_step=step)
    assert {rid for s in trace for rid, _ in s} == {r.request_id for wave in waves for r in wave}
    assert len(ticks) >= 3, "the reclaimer thread never ran beside the steps"


def test_asynchronous_loads_leave_arc_where_loads_in_front_of_the_step_leave_it(patched, monkeypatch):
    """The same trace through both load paths: the host tier's policy sees the same requests in the same
    order (one hit per loaded block, in prefix order, when the load is planned), so ARC's lists and p match.
    Memory stays enough to admit every request at once, where the two paths make the same lookups."""
    snapshots, traces, counts = [], [], []
    for in_front in (True, False):
        with monkeypatch.context() as planned:
            if in_front:  # the plan beside a vLLM connector
                as_beside_a_connector(planned)
            scheduler, pool, _ = patched(limit_groups=3, cpu_bytes=16 * GROUP_BYTES)
        filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
        traces.append(drive(scheduler, [make_requests("a", 4, 320, 320, seed=0), *filler,
                                        make_requests("b", 4, 320, 320, seed=0)]))
        offload = scheduler.kvelastic_offload
        assert offload.tier.hits >= 19
        snapshots.append(offload.tier.policy.snapshot())
        counts.append((offload.tier.hits, offload.tier.misses))
    assert snapshots[0] == snapshots[1]
    # the same hits; misses counted per lookup on the sync path (a request's retries count again), per
    # admitted request whose run stopped at a key the host lacked on the async path
    assert counts[0][0] == counts[1][0] and 0 < counts[1][1] <= counts[0][1]
    assert prefill(traces[1], "b") == prefill(traces[0], "b")  # the same prompt tokens computed


@pytest.mark.parametrize("company", [False, True], ids=["alone", "beside-a-running-request"])
def test_auto_loads_a_lone_requests_host_run_in_front_of_the_step_and_beside_compute_otherwise(patched, company):
    """Hits load beside compute (the plan in process): a request alone in an idle engine takes its host run as GPU
    hits loaded in front of the step, and is scheduled in the step that finds them; with a request running
    beside it, the connector loads the run while it waits, and the other request's step does not wait."""
    from vllm.v1.request import RequestStatus

    from kvelastic.scheduler.engine_report import StatsLog

    scheduler, pool, _ = patched(limit_groups=3, cpu_bytes=16 * GROUP_BYTES)
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
    drive(scheduler, [make_requests("a", 1, 320, 320, seed=0), *filler])  # a's blocks pushed to the host
    offload = scheduler.kvelastic_offload
    before = offload.stats()
    (b,) = make_requests("b", 1, 320, 320, seed=0)  # a's prompt again
    if company:
        (c,) = make_requests("c", 1, 64, 0, seed=3, max_tokens=50)
        scheduler.add_request(c)
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_output(scheduler, out, {"c-0"}))
        assert c.status == RequestStatus.RUNNING
    scheduler.add_request(b)
    out = scheduler.schedule()
    after = offload.stats()
    loaded = after["host_hits"] - before["host_hits"]
    assert loaded >= 19 and after["reloaded_bytes"] - before["reloaded_bytes"] == loaded * offload.copier.bytes_per_block
    if company:
        assert "b-0" not in out.num_scheduled_tokens and b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert after["host_loads_async"] - before["host_loads_async"] == 1
        assert after["load_runs"] == before["load_runs"]
    else:
        assert out.num_scheduled_tokens["b-0"] == 320 - loaded * 16  # only what the host lacked is computed
        assert after["load_runs"] - before["load_runs"] == 1
        assert after["host_loads_async"] == before["host_loads_async"]
    report = StatsLog(types.SimpleNamespace(pool=pool), offload).line()  # type: ignore[arg-type]
    assert f"loads beside compute {int(company)}, in front of the step {int(not company)}," in report
    done = {r for r in out.num_scheduled_tokens
            if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
    scheduler.update_from_output(out, model_output(scheduler, out, done))
    drive(scheduler, [[]])  # the rest, to the end
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.num_output_tokens == 20


def test_the_engines_upkeep_grows_the_reserve_a_step_a_tick_and_covers_reloads_with_a_host_tier(patched):
    from kvelastic.scheduler.reclaimer import BUSY_STEP_BYTES, WarmReserve
    from kvelastic.scheduler.reload_reserve import MAX_BYTES

    for cpu, reloads in (({}, False), ({"cpu_bytes": 16 * GROUP_BYTES}, True)):
        scheduler, _, _ = patched(**cpu)
        warm = next(job for job in scheduler.kvelastic_reclaimer.jobs if isinstance(job, WarmReserve))
        assert warm.busy_step_bytes == BUSY_STEP_BYTES
        assert (warm.reloads is not None) == reloads
        assert not reloads or warm.reloads.cap_bytes == MAX_BYTES
