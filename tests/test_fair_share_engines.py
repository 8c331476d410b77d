"""The fair share between two engines over host-backed pools and vLLM's real block pool.

The engine above its share stops offering the blocks its running requests hold,
and the groups they leave go back to the account for the one that waits; the
one that waits says so from vLLM's own estimate, and pages it would keep warm
ahead of need are never a want (``tests/test_fair_share.py``: the rule itself).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

from kvelastic.scheduler.upkeep import engine_upkeep  # noqa: E402
from tests.test_cluster_link import PAGE, _linked_reclaimer, _NoLock, engine  # noqa: E402


@pytest.fixture
def engines(tmp_path, monkeypatch):
    """Two engines sharing a budget of 8 pages, left and closed after the test."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pair = (engine("a", budget=8 * PAGE, limit=None), engine("b", budget=8 * PAGE, limit=None))
    yield pair
    for eng in pair:
        eng[5].leave()
        eng[0].close()


def test_an_engine_above_its_share_stops_offering_blocks_and_gives_back_what_its_requests_leave(
        engines):
    a, b = engines
    a_pool, _, a_cache, a_bp, a_queue, a_link = a
    upkeep = _linked_reclaimer(a_queue, a_cache, a_link)
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


def test_the_cap_lifts_and_the_engine_may_grow_again_once_nobody_waits(engines):
    a, b = engines
    a_pool, _, a_cache, a_bp, a_queue, a_link = a
    upkeep = _linked_reclaimer(a_queue, a_cache, a_link)
    running = a_bp.get_new_blocks(5 * 32)
    assert b[0].grow_reserve(2) == 0
    upkeep.tick()
    assert a_pool.stats().limit_bytes == 4 * PAGE
    b[5].leave()  # the waiting engine is gone: nobody waits below a share
    upkeep.tick()
    assert a_pool.stats().limit_bytes is None
    assert a_queue.excess_blocks == 0 and a_bp.get_num_free_blocks() > 0
    a_bp.free_blocks(running)


def test_a_warm_reserve_that_cannot_grow_asks_for_nothing_and_so_never_waits(engines):
    """Pages kept warm ahead of need are not demand: a refusal for them would be a want, and a waiting
    engine is spared the others' pressure, so an engine done with its requests would keep its cache."""

    a, b = engines
    upkeep = engine_upkeep(b[4], b[2], _NoLock(), cache_ttl_s=60.0, reserve_bytes=2 * PAGE, link=b[5])
    held = a[3].get_new_blocks(6 * 32 - 16)  # a holds 7 of the 8 pages: room for one more
    b[2].forget_device_free()
    upkeep.tick()  # b is busy (it allocated lately): it keeps what fits of its 2 warm pages
    assert b[0].stats().reserve_bytes <= PAGE
    info = b[5].member.info()
    assert info.wanted_bytes == 0 and info.waiting_since is None
    a[3].free_blocks(held)


def test_a_request_that_does_not_fit_is_a_want_that_caps_the_engine_above_its_share(engines):
    """The scheduler asks nothing while its headroom is short; its estimate for a waiting request tells the
    account instead (the commit guard's map_for), and that want is what the others' fair share answers."""
    a, b = engines
    upkeep = _linked_reclaimer(a[4], a[2], a[5])
    running = a[3].get_new_blocks(6 * 32 - 16)  # a holds 7 of the 8 pages in running requests
    b[2].forget_device_free()
    assert b[5].member.info().wanted_bytes == 0
    assert b[4].map_for(3 * 32)  # vLLM's estimate for b's waiting request: 3 groups it cannot have
    info = b[5].member.info()
    assert info.wanted_bytes >= 2 * PAGE and info.waiting_since is not None
    upkeep.tick()
    assert a[0].stats().limit_bytes == 4 * PAGE
    a[3].free_blocks(running)
