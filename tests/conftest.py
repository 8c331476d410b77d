"""Shared fixtures: a host-backed page pool with small pages, so tests run fast on any CPU."""

from __future__ import annotations

import logging

import pytest

from kvelastic.pool import HostBackend, PagePool

SMALL_PAGE = 64 * 1024


@pytest.fixture
def host_pool():
    pool = PagePool.standard(HostBackend(), page_bytes=SMALL_PAGE)
    yield pool
    pool.close()
    assert pool.leak_report() == []


def pytest_configure(config):
    """In CI a missing vLLM is an error, never a silent skip of the integration tests."""
    import importlib.util
    import os

    if os.environ.get("KVELASTIC_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("KVELASTIC_REQUIRE_VLLM=1 but vllm is not installed")


@pytest.fixture
def kv_log(caplog):
    """Records of kvelastic's logger, 'vllm.kvelastic': vLLM's 'vllm' logger does not pass them on to the root."""
    logger = logging.getLogger("vllm.kvelastic")
    caplog.set_level(logging.INFO, logger="vllm.kvelastic")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)
