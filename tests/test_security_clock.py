"""A wall clock stepped back: wants and fair-share caps lapse as they would without the step.

Times in an account are wall-clock times, since every process reads them.
After the clock stepped back by an hour, a want written before the step was an
hour in the future: it counted for the whole hour, and so did the fair-share
cap it put on the other members. Ages are now bounded both ways.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvelastic.cluster import SharedAccount, policy
from kvelastic.cluster import storage
from kvelastic.cluster.records import MemberRecord

GPU = "GPU-clock"
STEP_S = 3600.0


class SteppedClock:
    def __init__(self, start: float):
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    stepped = SteppedClock(1.9e9)
    monkeypatch.setattr(storage, "time", SimpleNamespace(time=stepped))
    return stepped


def test_a_want_written_before_the_clock_stepped_back_does_not_cap_the_others(clock):
    with SharedAccount.open(GPU, 1000) as account:
        busy, waiting = account.join("busy"), account.join("waiting")
        assert busy.acquire(900)
        busy.report(cached_bytes=0)  # all in use: no cache to give back
        assert not waiting.acquire(400)  # refused by the budget: a want, and a fair share of 500 for it
        assert busy.tick(cached_bytes=0).share_cap_bytes == 500  # held to its share while the other waits
        clock.now -= STEP_S  # the wall clock steps back an hour (NTP, a VM restored, a manual date)
        tick = busy.tick(cached_bytes=0)
        assert tick.share_cap_bytes == 0 and tick.pressure_bytes == 0, "an hour-old want still held the cap"
        assert account.demand() == 0
        assert account.member("waiting").wanted_bytes == 400 and account.member("waiting").waiting_since is None
        assert not waiting.acquire(400)  # a fresh refusal after the step counts again, at once
        assert busy.tick(cached_bytes=0).share_cap_bytes == 500


def test_a_want_lapses_after_its_time_to_live_whichever_way_the_clock_moved():
    record = MemberRecord(name="a", pid=1, wanted_bytes=10, wanted_at=1000.0, slot=0)
    for now, counts in ((1000.0, True), (1004.0, True), (1006.0, False), (996.0, True), (994.0, False),
                        (1000.0 - STEP_S, False)):
        assert policy.wanting(record, now, 5.0) is counts, now
        assert policy.short_lately(record, now, 5.0) is counts, now
