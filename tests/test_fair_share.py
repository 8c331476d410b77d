"""The fair share rule: a member that waits below its part of the budget gets it back from those above theirs.

On a real account file, with members of one process, as the engines' upkeep
reads it; ``tests/test_fair_share_engines.py`` runs it between two engines.
"""

from __future__ import annotations

import pytest

from kvelastic.cluster import SharedAccount, policy

GPU = "GPU-fair-0000"


@pytest.fixture
def account(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    acct = SharedAccount.open(GPU, 1200)
    yield acct
    acct.close()


def test_nobody_is_capped_while_nobody_waits(account):
    a, b, c = account.join("a"), account.join("b"), account.join("c")
    assert a.acquire(1100)  # one busy member may borrow nearly the whole budget
    assert a.tick().share_cap_bytes == 0
    assert b.tick().share_cap_bytes == c.tick().share_cap_bytes == 0


def test_a_member_waiting_below_its_share_caps_the_one_above_at_its_share(account):
    a, b, c = account.join("a"), account.join("b"), account.join("c")
    assert a.acquire(1100)
    assert not b.acquire(200)  # refused by the budget: a want, and b holds nothing of its 400
    assert a.tick().share_cap_bytes == 600  # 1200 / the 2 busy members (idle c's part is theirs)
    assert b.tick().share_cap_bytes == 0  # the waiting one is below its share: never capped
    assert a.tick(cached_bytes=0).pressure_bytes == 0  # nothing cached: the cap is what makes it shrink
    assert c.acquire(100) and c.tick(cached_bytes=0).share_cap_bytes == 0  # c now uses a real part...
    assert a.tick().share_cap_bytes == 400  # ...so the busy are three: 1200 / 3


def test_no_cap_once_the_waiting_member_holds_its_share(account):
    a, b = account.join("a"), account.join("b")
    assert a.acquire(700) and b.acquire(500)
    assert not b.acquire(100)  # b waits holding 500 of its 600
    assert a.tick().share_cap_bytes == 600
    a.release(100)
    assert b.acquire(100)  # b at its share; its want is cleared by the grant
    assert not b.acquire(50)  # waiting again, but at its share: first come from here
    assert a.tick().share_cap_bytes == 0


def test_a_member_at_its_share_is_held_there_and_one_below_it_is_never_capped(account):
    a, b = account.join("a"), account.join("b")
    assert a.acquire(600) and b.acquire(100)
    assert not b.acquire(600)  # 700 + 600 > 1200
    assert a.tick().share_cap_bytes == 600  # a holds exactly its share: it keeps it, and does not grow
    a.release(100)
    assert a.tick().share_cap_bytes == 0  # below its share, a is never capped


def test_a_reservation_larger_than_the_equal_part_is_the_share(account):
    a = account.join("a", min_bytes=900)
    b = account.join("b")
    assert a.acquire(1000)
    assert not b.acquire(300)
    assert a.tick().share_cap_bytes == 900  # never below its reservation
    assert account.join("c").tick().share_cap_bytes == 0


def test_the_cap_ends_when_the_want_lapses(account, monkeypatch):
    from types import SimpleNamespace

    from kvelastic.cluster import storage

    now = [1000.0]
    monkeypatch.setattr(storage, "time", SimpleNamespace(time=lambda: now[0]))
    a, b = account.join("a"), account.join("b")
    assert a.acquire(1200) and not b.acquire(10)
    assert a.tick().share_cap_bytes == 600
    now[0] += policy.DEFAULT_WANT_TTL_S + 0.01  # b's demand went away
    assert a.tick().share_cap_bytes == 0


def test_the_cap_outlives_the_grants_that_meet_the_want_a_group_at_a_time(account, monkeypatch):
    """A waiting engine is granted its want piece by piece; each grant must not free the one above its share."""
    from types import SimpleNamespace

    from kvelastic.cluster import storage

    now = [1000.0]
    monkeypatch.setattr(storage, "time", SimpleNamespace(time=lambda: now[0]))
    a, b = account.join("a"), account.join("b")
    assert a.acquire(1100) and not b.acquire(200)  # b short, holding nothing of its 600
    assert a.tick().share_cap_bytes == 600
    a.release(100)
    assert b.acquire(100)  # the grant clears b's want...
    assert b.info().wanted_bytes == 0
    now[0] += 1.0
    assert a.tick().share_cap_bytes == 600  # ...but b is still below its share and was short 1 s ago
    now[0] += policy.DEFAULT_WANT_TTL_S  # no refusal since: b's demand is met
    assert a.tick().share_cap_bytes == 0


def test_a_small_want_met_at_once_does_not_hold_a_busy_neighbour_down(account):
    """One request on an idle model: once its want is met it presses no more, so the busy one is not capped."""
    a, c = account.join("a"), account.join("c")
    assert a.acquire(1150) and not c.acquire(100)  # c's one request does not fit: it waits
    assert a.tick().share_cap_bytes == 600  # while it waits, a is held to its share
    a.release(50)
    assert c.acquire(50)  # met; c uses 50, under an eighth of an equal part (1200 / 2 / 8 = 75)
    assert a.tick().share_cap_bytes == 0  # c was short a moment ago, but it does not work: no cap
