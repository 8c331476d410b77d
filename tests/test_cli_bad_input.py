"""Bad input to the ``kvelastic`` command ends in a message and exit 2, never a traceback.

A fuzz over the invocations the issue lists (``reset ''``, ``--gpu ' '``,
``status --watch nan``/``inf``, ``top --interval inf``, sizes of 2^64 and more,
``budget -5GiB``) and more of their kind, run through the console script's
``main`` against a real account with a live member; then random size text.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvelastic import cli
from kvelastic.cluster import SharedAccount

GIB = 1024**3
BIG = [str(1 << 64), str(1 << 70), "5000000TiB", "99999999999999999999999999999", f"{1 << 62}.5"]
SIZES = BIG + ["-5GiB", "-1", "-.5GiB", "nan", "inf", "-inf", "1e9", "0x10", "1_000", "١٢٣GiB", "", " ", "GiB",
               "1.5.5GiB", "5 G i B", "\x1b[2J", "4G", "4g"]
BAD = (
    [["reset", ""], ["reset", " "], ["reset", "\t"], ["status", "--gpu", " "], ["status", "--gpu", ""],
     ["budget", "--gpu", ""], ["budget", "1GiB", "--gpu", "  "], ["limit", "engine", "1GiB", "--gpu", " "],
     ["top", "--gpu", " ", "--count", "1"]]
    + [["status", "--watch", value] for value in ("nan", "inf", "-inf", "-1", "0", "1e308", "abc", "")]
    + [["top", "--interval", value, "--count", "1"] for value in ("inf", "nan", "1e999", "0", "-2", "x")]
    + [["top", "--count", value] for value in ("0", "-1", "x", "1.5", str(1 << 70) + "x")]
    + [["budget", size] for size in SIZES]
    + [["limit", "engine", size] for size in SIZES]
    + [["limit", "engine", "--max", size] for size in BIG + ["-1GiB", "nan", "0", "off"]]
    + [["limit", "engine", "--min", size] for size in BIG + ["-1GiB", "nan"]]
    + [["limit", "", "1GiB"], ["limit", "é", "1GiB"], ["limit", "a" * 65, "1GiB"], ["limit", "engine"],
       ["limit", "engine", "1GiB", "--max", "2GiB"], ["frobnicate"], ["status", "--bogus"], []]
)


@pytest.fixture(scope="module")
def account(tmp_path_factory):
    shared = tmp_path_factory.mktemp("cli-bad-input")
    old = os.environ.get("KVELASTIC_SHARED_DIR")
    os.environ["KVELASTIC_SHARED_DIR"] = str(shared)
    with SharedAccount.open("GPU-fuzz", 40 * GIB) as opened:
        opened.join("engine", max_bytes=8 * GIB, min_bytes=GIB)
        yield opened
    if old is None:
        os.environ.pop("KVELASTIC_SHARED_DIR")
    else:
        os.environ["KVELASTIC_SHARED_DIR"] = old


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``kvelastic ARGV`` through the console script's entry point: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv", BAD, ids=[repr(a)[:60] for a in BAD])
def test_bad_input_ends_in_a_message_and_exit_2(account, argv):
    code, out, err = run_cli(argv)  # an exception here is the traceback the user would see
    assert code == 2, (argv, code, out, err)
    assert err.strip() and "Traceback" not in err
    assert "\x1b" not in err
    assert account.budget == 40 * GIB and account.member("engine").max_bytes == 8 * GIB  # nothing changed


def test_a_negative_budget_gets_its_own_message_not_the_top_level_usage(account):
    code, _, err = run_cli(["budget", "-5GiB"])
    assert code == 2 and err.startswith("kvelastic budget: SIZE='-5GiB' is a negative size")
    assert "usage: kvelastic [-h]" not in err


@given(text=st.text(max_size=24))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_size_text_is_a_change_or_exit_2(account, text):
    for argv in (["budget", text], ["limit", "engine", "--max", text], ["limit", "engine", "--min", text]):
        code, out, err = run_cli(argv)
        assert code in (0, 2), (argv, code, out, err)
        assert "Traceback" not in err
    account.set_limits("engine", min_bytes=GIB, max_bytes=8 * GIB)
    account.set_budget(40 * GIB)


def test_the_installed_command_answers_bad_input_without_a_traceback(account):
    env = {**os.environ}
    for argv in (["reset", ""], ["status", "--watch", "inf"], ["budget", str(1 << 64)], ["top", "--interval", "nan"]):
        done = subprocess.run([sys.executable, "-m", "kvelastic.cli", *argv], capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (argv, done.stderr)
