"""Reclaim latency timed by the engines: waits for the shared budget, releases for others' wants.

Shared state is real: account files in a temporary folder, a member in another process,
``kvelastic status --json`` run as a command. The pools are host-memory pools.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from kvelastic.cluster import SharedAccount
from kvelastic.cluster.records import MemberRecord, _RECORD
from kvelastic.cluster.source import SharedBudgetSource
from kvelastic.scheduler import reclaim_timing
from kvelastic.metrics.metrics import KvelasticCollector, StatsPublisher
from kvelastic.scheduler.reclaim_timing import Episode, ReclaimTiming, format_line, parse_left_out, parse_line
from kvelastic.scheduler.upkeep import engine_upkeep
from kvelastic.pool import DeviceSource, HostBackend
from tests.kv_fixtures import StandInRequest
from tests.test_cluster_link import PAGE, _NoLock, engine

prometheus_client = pytest.importorskip("prometheus_client")

HOLDER = """\
import sys
from kvelastic.cluster import SharedAccount
gpu, budget, held = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
member = SharedAccount.open(gpu, budget).join("holder")
assert member.acquire(held)
member.report(cached_bytes=held)
print("holding", flush=True)
sys.stdin.readline()
member.release(held)
print("released", flush=True)
sys.stdin.readline()
"""


def _upkeep(eng, publisher=None):
    pool, _, cache, _, queue, link = eng
    return engine_upkeep(queue, cache, _NoLock(), cache_ttl_s=60.0, reserve_bytes=0, link=link, publisher=publisher)


def _status(tmp_path) -> dict:
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "kvelastic.cli", "status", "--json"], env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {m["name"]: m for acct in json.loads(done.stdout)["accounts"] for m in acct["members"]}


def _records(kv_log) -> list[logging.LogRecord]:
    """Each record once (it reaches the capture through the logger's handler and, where vLLM lets it
    propagate, through the root's)."""
    return list({id(r): r for r in kv_log.records}.values())


def _logged(kv_log) -> list[Episode]:
    return [e for e in (parse_line(r.getMessage()) for r in _records(kv_log)) if e is not None]


def test_a_wait_for_memory_another_process_holds_is_timed_from_refusal_to_grant(tmp_path, monkeypatch, kv_log):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(tmp_path)}
    b = engine("b", budget=8 * PAGE, limit=None)
    rest = 8 * PAGE - b[5].member.info().mapped_bytes  # b holds its null group and one mapped ahead
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, b[5].gpu_id, str(8 * PAGE), str(rest)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        began, began_wall = time.monotonic(), time.time()
        assert b[0].grow_reserve(1) == 0  # refused by the budget: the wait begins
        refused_wall = time.time()
        assert b[0].grow_reserve(1) == 0  # a second refusal goes on with the same wait
        status = _status(tmp_path)
        assert began_wall <= status["b"]["waiting_since"] <= refused_wall  # the account's clock, from the file
        assert status["holder"]["waiting_since"] is None
        time.sleep(0.1)
        holder.stdin.write("release\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        assert b[0].grow_reserve(1) == 1  # granted and created: the wait ends
        ended = time.monotonic()
        timing = b[5].timing
        assert timing.waits.count == 1 and timing.lapsed_waits == 0
        assert 0.1 <= timing.waits.sum <= ended - began  # it spans the sleep, inside what the test saw
        assert _status(tmp_path)["b"]["waiting_since"] is None  # the grant ended it in the account too
        _upkeep(b).tick()  # the upkeep thread writes the line
        [line] = _logged(kv_log)
        assert (line.kind, line.outcome, line.instance, line.events) == ("wait", "granted", "b", 2)
        assert (line.asked_bytes, line.moved_bytes) == (PAGE, PAGE)
        assert line.seconds == pytest.approx(timing.waits.sum, abs=1e-6)
        assert began_wall <= line.began <= refused_wall
    finally:
        holder.kill()
        holder.wait()
        b[5].leave()
        b[0].close()


def test_the_giver_times_its_release_and_both_sides_reach_the_metrics(tmp_path, monkeypatch, kv_log):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    a = engine("a", budget=8 * PAGE, limit=None)
    b = engine("b", budget=8 * PAGE, limit=None)
    publishers = {n: StatsPublisher(n, tmp_path / "stats", model_name="m") for n in "ab"}
    up_a, up_b = _upkeep(a, publishers["a"]), _upkeep(b, publishers["b"])
    try:
        blocks = a[3].get_new_blocks(4 * 32)
        a[3].cache_full_blocks(StandInRequest([b"a%d" % i for i in range(128)]), blocks, 0, 128, 16, 0)
        a[3].free_blocks(blocks)  # groups 1-4 hold only cached prefix blocks
        up_a.tick()  # nobody waits: nothing asked, nothing timed
        assert a[5].timing.releases.count == 0 and a[5].timing.released_bytes == 0
        assert b[0].grow_reserve(1) == 0
        asked = time.monotonic()
        up_a.tick()  # reads the pressure, gives back a cached group: the pages are destroyed in this tick
        released = time.monotonic()
        assert a[5].member.info().mapped_bytes <= 5 * PAGE
        assert b[0].grow_reserve(1) == 1
        up_a.tick()  # no pressure any more: the release ends
        up_b.tick()
        timing = a[5].timing
        assert timing.releases.count == 1 and timing.unserved_asks == 0
        assert 0 <= timing.releases.sum <= released - asked
        assert timing.released_bytes >= PAGE
        assert b[5].timing.waits.count == 1 and a[5].timing.waits.count == 0
        episodes = {(e.instance, e.kind): e for e in _logged(kv_log)}
        assert episodes["a", "release"].outcome == "released"
        assert episodes["a", "release"].moved_bytes == timing.released_bytes
        assert episodes["a", "release"].seconds == pytest.approx(timing.releases.sum, abs=1e-6)
        assert episodes["b", "wait"].outcome == "granted"
        registry = prometheus_client.CollectorRegistry()
        registry.register(KvelasticCollector(tmp_path / "stats", parents=(os.getpid(),)))
        text = prometheus_client.generate_latest(registry).decode()
        assert 'kvelastic_reclaim_wait_seconds_count{instance_name="b",model_name="m"} 1.0' in text
        assert 'kvelastic_reclaim_wait_seconds_bucket{instance_name="b",le="+Inf",model_name="m"} 1.0' in text
        assert 'kvelastic_reclaim_release_seconds_count{instance_name="a",model_name="m"} 1.0' in text
        assert (f'kvelastic_reclaim_released_bytes_total{{instance_name="a",model_name="m"}} '
                f'{float(timing.released_bytes)}') in text
        assert 'kvelastic_reclaim_lapsed_waits_total{instance_name="b",model_name="m"} 0.0' in text
    finally:
        for eng in (a, b):
            eng[5].leave()
            eng[0].close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def gated(tmp_path):
    """A page source over a real account of two pages, with a timing on a clock the test moves."""
    account = SharedAccount.open("GPU-timing", 2 * PAGE, directory=tmp_path)
    member = account.join("solo")
    source = SharedBudgetSource(DeviceSource(HostBackend(), PAGE), member)
    clock = Clock()
    source.observer = timing = ReclaimTiming("solo", source.lock, clock=clock)
    yield source, timing, clock
    account.close()


def test_a_wait_whose_demand_went_away_counts_as_lapsed_not_as_a_grant(gated, kv_log):
    source, timing, clock = gated
    held = source.acquire(2)
    with pytest.raises(Exception, match="may not map"):
        source.acquire(1)
    clock.now += 1.0
    with pytest.raises(Exception, match="may not map"):
        source.acquire(1)
    clock.now += timing.want_ttl_s + 0.5  # no refusal renewed the want: the account stopped counting it
    timing.tick(0)
    assert (timing.lapsed_waits, timing.waits.count) == (1, 0)
    [line] = _logged(kv_log)
    assert (line.outcome, line.seconds, line.events, line.moved_bytes) == ("lapsed", 1.0, 2, 0)
    source.release(held)
    with pytest.raises(Exception, match="may not map"):  # nothing held now, but 3 pages pass the budget
        source.acquire(3)
    clock.now += timing.want_ttl_s + 1.0
    source.acquire(1)  # a grant long after the want lapsed ends nothing as granted
    assert (timing.lapsed_waits, timing.waits.count) == (2, 0)
    assert timing.values()["reclaim_lapsed_waits"] == 2


def test_refusals_by_the_engines_own_cap_begin_no_wait(tmp_path):
    account = SharedAccount.open("GPU-cap", 8 * PAGE, directory=tmp_path)
    try:
        source = SharedBudgetSource(DeviceSource(HostBackend(), PAGE), account.join("capped", max_bytes=PAGE))
        source.observer = timing = ReclaimTiming("capped", source.lock)
        source.acquire(1)
        with pytest.raises(Exception, match="max"):
            source.acquire(1)
        assert timing._wait is None and timing.waits.count == 0
    finally:
        account.close()


def test_an_ask_withdrawn_before_any_release_counts_as_unserved(kv_log):
    clock = Clock()
    timing = ReclaimTiming("giver", clock=clock)
    timing.released(PAGE)  # nobody asked: not counted
    timing.tick(3 * PAGE)
    clock.now += 0.3
    timing.tick(0)
    assert (timing.unserved_asks, timing.releases.count, timing.released_bytes) == (1, 0, 0)
    timing.tick(2 * PAGE)
    clock.now += 0.1
    timing.released(PAGE)
    clock.now += 0.2
    timing.released(PAGE)  # covers the 2 pages first asked for, at 0.3 s
    timing.tick(4 * PAGE)  # asked for more meanwhile
    clock.now += 0.4
    timing.released(PAGE)
    timing.tick(0)
    assert timing.releases.count == 1 and timing.releases.sum == pytest.approx(0.3)
    lines = _logged(kv_log)
    assert [(e.outcome, e.moved_bytes, e.asked_bytes, e.events) for e in lines] == [
        ("unserved", 0, 3 * PAGE, 0), ("released", 3 * PAGE, 4 * PAGE, 3)]


def test_errors_in_the_timing_never_reach_the_allocation(gated, kv_log, monkeypatch):
    source, timing, clock = gated

    def broken(value: float) -> None:
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(timing.waits, "observe", broken)
    monkeypatch.setattr(timing.releases, "observe", broken)
    held = source.acquire(2)
    for _ in range(2):
        with pytest.raises(Exception, match="may not map"):
            source.acquire(1)
        source.release(held[:1])
        held = held[1:] + source.acquire(1)  # ends the wait: observe raises inside, the grant stands
    assert len(held) == 2 and source.outstanding_bytes == 2 * PAGE
    timing.tick(PAGE)
    timing.released(PAGE)
    timing.tick(0)  # ending the release raises inside too
    warnings = [r.getMessage() for r in _records(kv_log) if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "in created" in w]) == 1  # logged once, not per event
    assert len([w for w in warnings if "in tick" in w]) == 1


def test_a_storm_of_episodes_is_logged_within_the_rate(kv_log):
    clock = Clock()
    timing = ReclaimTiming("stormy", clock=clock)
    for _ in range(reclaim_timing.MAX_PENDING + 44):
        timing.refused(PAGE)
        timing.created(PAGE)
    timing.tick(0)
    assert len(_logged(kv_log)) == reclaim_timing.LOG_BURST
    assert sum(parse_left_out(r.getMessage()) for r in _records(kv_log)) == 44
    clock.now += 5.0
    timing.tick(0)
    assert len(_logged(kv_log)) == reclaim_timing.LOG_BURST + 5
    assert timing.waits.count == reclaim_timing.MAX_PENDING + 44  # the metrics count every one


def test_log_lines_round_trip_and_foreign_lines_are_ignored():
    episode = Episode("wait", "granted", "model-b", 0.4123456, 1.7e9 + 0.25, 3 << 20, 1 << 20, 3)
    line = "INFO 11-26 12:00:00 [reclaim_timing.py:1] " + format_line(episode)
    back = parse_line(line)
    assert back is not None and back.seconds == pytest.approx(episode.seconds, abs=1e-6)
    assert back == Episode(**{**episode.__dict__, "seconds": back.seconds, "began": back.began})
    assert parse_line("kvelastic: mapped 1 GiB") is None
    assert parse_line(line.replace("seconds=", "secs=")) is None
    assert parse_left_out("kvelastic: 3 lines left out reclaim-episodes-left-out count=3") == 3


# ------------------------------------------------------------------ the account's side
def test_the_account_keeps_when_a_run_of_refusals_began(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kvelastic.cluster import storage

    now = [1000.0]
    monkeypatch.setattr(storage, "time", SimpleNamespace(time=lambda: now[0]))
    with SharedAccount.open("GPU-since", 1000, directory=tmp_path) as account:
        a, b = account.join("a"), account.join("b")
        assert a.acquire(1000)
        assert not b.acquire(10) and b.info().waiting_since == 1000.0
        now[0] += 3.0
        assert not b.acquire(20) and b.info().waiting_since == 1000.0  # the same wait goes on
        now[0] += account.want_ttl_s + 1.0
        assert b.info().waiting_since is None  # lapsed: shown no more
        assert not b.acquire(10) and b.info().waiting_since == now[0]  # a new wait
        assert b.request(0).granted and b.info().waiting_since == now[0]  # a probe changes nothing
        a.release(10)
        assert b.acquire(10) and b.info().waiting_since is None


def test_a_record_from_a_writer_without_the_field_reads_as_not_waiting():
    record = MemberRecord(name="old", pid=7, wanted_bytes=5, wanted_at=2.0, waiting_since=1.5, slot=0)
    assert MemberRecord.unpack(record.pack(), 0).waiting_since == 1.5
    older = record.pack()[:_RECORD.size - 8].ljust(len(record.pack()), b"\0")  # the field's room left zero
    assert MemberRecord.unpack(older, 0).waiting_since == 0.0
    with pytest.raises(Exception, match="time"):
        MemberRecord.unpack(MemberRecord(name="bad", pid=7, waiting_since=float("nan")).pack(), 0)
