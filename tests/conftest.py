"""Shared fixtures: a host-backed page pool with small pages, so tests run fast on any CPU."""

from __future__ import annotations

import pytest

from kvelastic.pool import HostBackend, PagePool

SMALL_PAGE = 64 * 1024


@pytest.fixture
def host_pool():
    pool = PagePool(HostBackend(), page_bytes=SMALL_PAGE)
    yield pool
    pool.close()
    assert pool.leak_report() == []
