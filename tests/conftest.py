"""Shared fixtures: a host-backed page pool with small pages, so tests run fast on any CPU.

The tests import ``tests.*`` and ``kvelastic_dev`` from the checkout, which
are not installed; ``kvelastic`` itself must come from where it is installed
(an editable install is the checkout again): the checkout's ``kvelastic``
folder alone has no ``kvelastic.patches``, which the installed package maps
from ``patches/``. So the checkout goes on ``sys.path`` last, never first:
``pip install .`` then ``pytest`` (or ``python -m pytest``, which puts the
current folder first) tests the installed kvelastic.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT] + [str(ROOT)]

import importlib  # noqa: E402 - after the path is set
import importlib.util  # noqa: E402
import logging  # noqa: E402

import pytest  # noqa: E402

from kvelastic.pool import HostBackend, PagePool  # noqa: E402

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
