"""The fair share: a member that waits below its part of the budget gets it back from those above theirs.

First the rule on a real account file (members of one process, as the engines'
upkeep reads it), then two engines over host-backed pools and vLLM's real block
pool: the one above its share stops offering blocks its running requests hold,
and the groups they leave go back to the account for the one that waits.
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


def test_a_member_at_or_below_its_share_is_never_capped(account):
    a, b = account.join("a"), account.join("b")
    assert a.acquire(600) and b.acquire(100)
    assert not b.acquire(600)  # 700 + 600 > 1200
    assert a.tick().share_cap_bytes == 0  # a holds exactly its share


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


# ----------------------------------------------------------- two engines
block_pool_module = pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

from tests.test_cluster_link import PAGE, _linked_reclaimer, engine  # noqa: E402


def test_an_engine_above_its_share_stops_offering_blocks_and_gives_back_what_its_requests_leave(
        tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    a = engine("a", budget=8 * PAGE, limit=None)
    b = engine("b", budget=8 * PAGE, limit=None)
    a_pool, _, a_cache, a_bp, a_queue, a_link = a
    upkeep = _linked_reclaimer(a_queue, a_cache, a_link)
    try:
        running = a_bp.get_new_blocks(5 * 32)  # a's running requests: groups 1-5 (6 pages with the null group)
        assert a_link.member.info().mapped_bytes >= 6 * PAGE
        assert b[0].grow_reserve(2) == 0  # b (holding its null group) is refused: it waits below its 4 pages
        upkeep.tick()
        assert a_pool.stats().limit_bytes == 4 * PAGE  # capped at 8 pages / 2 engines
        assert a_bp.get_num_free_blocks() == 0  # the free blocks it has are owed to b: none offered
        a_bp.free_blocks(running[-3 * 32:])  # three groups' requests finish (nothing cached: plain free)
        a_queue.set_idle()
        upkeep.tick()
        a_pool.collect(wait=True)
        assert a_link.member.info().mapped_bytes <= 4 * PAGE  # back within its share
        b[2].forget_device_free()
        assert b[0].grow_reserve(2) == 2  # and b gets what a gave back
    finally:
        for eng in (a, b):
            eng[5].leave()
            eng[0].close()


def test_the_cap_lifts_and_the_engine_may_grow_again_once_nobody_waits(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    a = engine("a", budget=8 * PAGE, limit=None)
    b = engine("b", budget=8 * PAGE, limit=None)
    a_pool, _, a_cache, a_bp, a_queue, a_link = a
    upkeep = _linked_reclaimer(a_queue, a_cache, a_link)
    try:
        running = a_bp.get_new_blocks(5 * 32)
        assert b[0].grow_reserve(2) == 0
        upkeep.tick()
        assert a_pool.stats().limit_bytes == 4 * PAGE
        b[5].leave()  # the waiting engine is gone: nobody waits below a share
        upkeep.tick()
        assert a_pool.stats().limit_bytes is None
        assert a_queue.excess_blocks == 0 and a_bp.get_num_free_blocks() > 0
        a_bp.free_blocks(running)
    finally:
        for eng in (a, b):
            eng[5].leave()
            eng[0].close()


def test_a_warm_reserve_that_cannot_grow_asks_for_nothing_and_so_never_waits(tmp_path, monkeypatch):
    """Pages kept warm ahead of need are not demand: a refusal for them would be a want, and a waiting
    engine is spared the others' pressure, so an engine done with its requests would keep its cache."""
    from kvelastic.scheduler.upkeep import engine_upkeep
    from tests.test_cluster_link import _NoLock

    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    a = engine("a", budget=8 * PAGE, limit=None)
    b = engine("b", budget=8 * PAGE, limit=None)
    upkeep = engine_upkeep(b[4], b[2], _NoLock(), cache_ttl_s=60.0, reserve_bytes=2 * PAGE, link=b[5])
    try:
        held = a[3].get_new_blocks(6 * 32 - 16)  # a holds 7 of the 8 pages: room for one more
        b[2].forget_device_free()
        upkeep.tick()  # b is busy (it allocated lately): it keeps what fits of its 2 warm pages
        assert b[0].stats().reserve_bytes <= PAGE
        info = b[5].member.info()
        assert info.wanted_bytes == 0 and info.waiting_since is None
        a[3].free_blocks(held)
    finally:
        for eng in (a, b):
            eng[5].leave()
            eng[0].close()


def test_a_request_that_does_not_fit_is_a_want_that_caps_the_engine_above_its_share(tmp_path, monkeypatch):
    """The scheduler asks nothing while its headroom is short; its estimate for a waiting request tells the
    account instead (the commit guard's map_for), and that want is what the others' fair share answers."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    a = engine("a", budget=8 * PAGE, limit=None)
    b = engine("b", budget=8 * PAGE, limit=None)
    upkeep = _linked_reclaimer(a[4], a[2], a[5])
    try:
        running = a[3].get_new_blocks(6 * 32 - 16)  # a holds 7 of the 8 pages in running requests
        b[2].forget_device_free()
        assert b[5].member.info().wanted_bytes == 0
        assert b[4].map_for(3 * 32)  # vLLM's estimate for b's waiting request: 3 groups it cannot have
        info = b[5].member.info()
        assert info.wanted_bytes >= 2 * PAGE and info.waiting_since is not None
        upkeep.tick()
        assert a[0].stats().limit_bytes == 4 * PAGE
        a[3].free_blocks(running)
    finally:
        for eng in (a, b):
            eng[5].leave()
            eng[0].close()
