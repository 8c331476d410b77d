"""CI's passes over the suite (tests/suite_parts.py, conftest.py) cover every test file exactly once
per band, and the lists name files and tests that exist: a file renamed or deleted would otherwise
leave a name that selects nothing, and its successor would run in a pass it was not meant for."""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import _left_out
from tests.suite_parts import BAND_TESTS, VERSION_FREE, WALL_CLOCK

TESTS = Path(__file__).resolve().parent
FILES = sorted(path.relative_to(TESTS).as_posix() for path in TESTS.rglob("test_*.py"))


def _options(files: str, pace: str) -> SimpleNamespace:
    return SimpleNamespace(getoption={"files": files, "pace": pace}.__getitem__)


def _passes_holding(name: str, files_options: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(files, pace) for files, pace in product(files_options, ("parallel", "serial"))
            if not _left_out(name, _options(files, pace))]


def test_every_listed_file_and_test_exists():
    assert sorted((VERSION_FREE | WALL_CLOCK) - set(FILES)) == []
    for name in BAND_TESTS:
        file, _, test = name.partition("::")
        assert file in VERSION_FREE, f"{name}: a band test of a file that runs in every band anyway"
        assert re.search(rf"^def {re.escape(test)}\(", (TESTS / file).read_text(), re.M), f"{name} is not defined"


def test_the_newest_band_runs_each_file_in_one_pass_and_a_band_tests_file_in_two():
    for name in FILES:
        held = _passes_holding(name, ("version-free", "per-band"))
        pace = "serial" if name in WALL_CLOCK else "parallel"
        if any(test.startswith(name + "::") for test in BAND_TESTS):
            assert held == [("version-free", pace), ("per-band", pace)], name
        else:
            assert held == [("version-free" if name in VERSION_FREE else "per-band", pace)], name


def test_an_older_band_runs_the_files_that_depend_on_the_band():
    band_test_files = {test.partition("::")[0] for test in BAND_TESTS}
    for name in FILES:
        held = _passes_holding(name, ("per-band",))
        assert (held != []) == (name not in VERSION_FREE or name in band_test_files), name
