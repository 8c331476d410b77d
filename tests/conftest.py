"""Shared fixtures: a host-backed page pool with small pages, so tests run fast on any CPU.

Also the options that split the suite into CI's passes (``scripts/run_tests.sh``;
``tests/suite_parts.py`` says which file goes where and why):

- ``--files=version-free`` collects only the files whose tests import no package
  that differs between bands, and makes vLLM's, torch's and transformers' imports
  fail in this process and every Python it starts, so such a file cannot leave
  the older bands while depending on them; ``--files=per-band`` collects the
  others, and the BAND_TESTS of version-free files.
- ``--pace=serial`` collects only the wall-clock-sensitive files; ``--pace=parallel``
  the others (the ones xdist may run two at a time).
- ``--contact-cases=one-per-kind``: ``tests/test_contact_refusal.py`` breaks one
  contact per kind of breakage instead of every contact.

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
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from kvelastic.pool import HostBackend, PagePool  # noqa: E402
from tests.suite_parts import BAND_TESTS, VERSION_FREE, WALL_CLOCK  # noqa: E402

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


# Hypothesis fails an example that takes over 200 ms by default: a wall-clock check that none of the
# property tests means (each says what it checks), and one that two busy xdist workers on two cores
# break (an example of page arithmetic took 236 ms there). Tests that set a deadline keep theirs.
settings.register_profile("kvelastic", deadline=None)
settings.load_profile("kvelastic")

TESTS = Path(__file__).resolve().parent
#: Packages a version-free file must not import: those whose release differs between bands.
BAND_PACKAGES = ("vllm", "torch", "transformers")
BLOCKED_DIR = pytest.StashKey[str]()


def pytest_addoption(parser):
    group = parser.getgroup("kvelastic", "CI's passes over the suite (tests/suite_parts.py)")
    group.addoption("--files", choices=("all", "version-free", "per-band"), default="all",
                    help="version-free: only the files that import no package that differs between bands "
                         "(vllm, torch, transformers: their imports then fail); per-band: only the others")
    group.addoption("--pace", choices=("all", "serial", "parallel"), default="all",
                    help="serial: only the wall-clock-sensitive files; parallel: only the others")
    group.addoption("--contact-cases", choices=("all", "one-per-kind"), default="all",
                    help="one-per-kind: test_contact_refusal breaks one contact per kind of breakage")


def pytest_configure(config):
    """In CI a missing vLLM is an error, never a silent skip of the integration tests."""
    if os.environ.get("KVELASTIC_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("KVELASTIC_REQUIRE_VLLM=1 but vllm is not installed")
    if config.getoption("files") == "version-free":
        config.stash[BLOCKED_DIR] = _block_band_packages()


def pytest_unconfigure(config):
    if BLOCKED_DIR in config.stash:
        shutil.rmtree(config.stash[BLOCKED_DIR], ignore_errors=True)


def _block_band_packages() -> str:
    """Put packages named like the BAND_PACKAGES whose import raises first on this process's path and on
    PYTHONPATH (for the processes tests start). A RuntimeError, not an ImportError: a test that
    would skip without vLLM (``pytest.importorskip``) fails instead, naming its file."""
    loaded = [name for name in BAND_PACKAGES if name in sys.modules]
    if loaded:
        raise pytest.UsageError(f"--files=version-free: {loaded} already imported before the tests")
    folder = tempfile.mkdtemp(prefix="kvelastic-blocked-")
    for name in BAND_PACKAGES:
        os.mkdir(os.path.join(folder, name))
        with open(os.path.join(folder, name, "__init__.py"), "w") as init:
            init.write(f"raise RuntimeError('import {name} in a file that tests/suite_parts.py lists as "
                       f"VERSION_FREE: the test depends on the band; list it in BAND_TESTS there')\n")
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
    return folder


BAND_TEST_FILES = frozenset(name.partition("::")[0] for name in BAND_TESTS)


def _left_out(relative: str, config) -> bool:
    """Whether the options leave the test file ``relative`` (to tests/) to another pass."""
    files, pace = config.getoption("files"), config.getoption("pace")
    if files == "version-free" and relative not in VERSION_FREE:
        return True
    if files == "per-band" and relative in VERSION_FREE and relative not in BAND_TEST_FILES:
        return True
    return pace != "all" and (pace == "serial") != (relative in WALL_CLOCK)


def _relative(path: Path) -> str | None:
    """``path`` below tests/, as suite_parts spells it; None outside tests/."""
    try:
        return path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None


def _test_name(item: pytest.Item) -> str:
    """``file::test`` as BAND_TESTS spells it: the path below tests/, no parameters."""
    return "::".join([str(_relative(item.path)), *item.nodeid.split("::")[1:]]).partition("[")[0]


def pytest_collection_modifyitems(config, items):
    """Of a version-free file, ``--files=per-band`` keeps only its BAND_TESTS, ``version-free`` the rest."""
    files = config.getoption("files")
    if files == "all":
        return
    kept, dropped = [], []
    for item in items:
        in_band = _test_name(item) in BAND_TESTS
        free = _relative(item.path) in VERSION_FREE
        wanted = (free and not in_band) if files == "version-free" else (not free or in_band)
        (kept if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


class LeftToAnotherPass(pytest.File):
    """A test file named on the command line that this pass leaves out: found, but holds no test
    here (pytest would call a file that yields no collector "not found")."""

    def collect(self):
        return []


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """Files left to another pass are not even imported (importing vLLM is much of a file's cost)."""
    collected = yield
    relative = _relative(file_path)
    if relative is None or file_path.suffix != ".py" or not file_path.name.startswith("test_") \
            or not _left_out(relative, parent.config):
        return collected
    return [LeftToAnotherPass.from_parent(parent, path=file_path)] if parent.session.isinitpath(file_path) else []


def pytest_report_header(config):
    if (config.getoption("files"), config.getoption("pace")) == ("all", "all"):
        return None
    every = [str(_relative(path)) for path in TESTS.rglob("test_*.py")]
    kept = [name for name in every if not _left_out(name, config)]
    return (f"kvelastic pass --files={config.getoption('files')} --pace={config.getoption('pace')}: "
            f"{len(kept)} of {len(every)} test files; the others run in another pass (tests/suite_parts.py)")


@pytest.fixture
def kv_log(caplog, request):
    """Records of kvelastic's logger, 'vllm.kvelastic': vLLM's 'vllm' logger does not pass them on to the root.

    vLLM configures its loggers when ``vllm.logger`` is first imported, and that configuration
    strips the handlers of every existing child of 'vllm': so it is imported before the handler
    goes on, or a test whose code imports vLLM first (run alone, say) would record nothing.
    Where vLLM is blocked (``--files=version-free``) nothing can import it."""
    if importlib.util.find_spec("vllm") is not None and BLOCKED_DIR not in request.config.stash:
        importlib.import_module("vllm.logger")
    logger = logging.getLogger("vllm.kvelastic")
    caplog.set_level(logging.INFO, logger="vllm.kvelastic")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)
