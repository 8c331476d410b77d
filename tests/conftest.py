"""Shared fixtures: a host-backed page pool with small pages, so tests run fast on any CPU."""

from __future__ import annotations

import importlib
import importlib.util
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


def pytest_sessionfinish(session, exitstatus):
    """Stop the forkserver the TP tests' ranks fork from (``tests/tp_ranks.py``), if one started: it ends with
    the session, reaped by it (its ranks' CPU counted as the session's), never left as an orphan."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def pytest_configure(config):
    """In CI a missing vLLM is an error, never a silent skip of the integration tests."""
    import os

    if os.environ.get("KVELASTIC_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("KVELASTIC_REQUIRE_VLLM=1 but vllm is not installed")


@pytest.fixture
def kv_log(caplog):
    """Records of kvelastic's logger, 'vllm.kvelastic': vLLM's 'vllm' logger does not pass them on to the root.

    vLLM configures its loggers when ``vllm.logger`` is first imported, and that configuration
    strips the handlers of every existing child of 'vllm': so it is imported before the handler
    goes on, or a test whose code imports vLLM first (run alone, say) would record nothing."""
    if importlib.util.find_spec("vllm") is not None:
        importlib.import_module("vllm.logger")
    logger = logging.getLogger("vllm.kvelastic")
    caplog.set_level(logging.INFO, logger="vllm.kvelastic")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)
