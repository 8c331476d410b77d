"""Sizes an account cannot store: every writer refuses what the readers would refuse.

The readers of an account refuse any byte count above ``units.MAX_BYTES``
(a forged or corrupt file), so a budget or limit above it written by the CLI or
a newcomer's ``KVELASTIC_SHARED_BUDGET`` made the account unreadable for every
engine of the GPU, and 2^64 or more ended in a ``struct.error`` traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvelastic.cluster import BadLimits, SharedAccount
from kvelastic.cluster.records import MAX_BYTES  # the readers' limit, which the writers share
from kvelastic.errors import ConfigError
from kvelastic.settings import Settings
from kvelastic.units import parse_size

GPU = "GPU-sizes"
GIB = 1024**3
HUGE = ["5000000TiB", str(1 << 64), str(1 << 70), f"{(1 << 62) + 1}", "99999999999999999999999TB"]
ENGINE = """
import sys
from kvelastic.cluster import SharedAccount
account = SharedAccount.open("GPU-sizes", 40 * 1024**3)
member = account.join("engine", max_bytes=8 * 1024**3)
member.acquire(1024**3)
print("joined", flush=True)
sys.stdin.read()
for _ in range(3):
    member.tick(cached_bytes=0)  # still a member of a readable account
print("ticked", flush=True)
"""


def _cli(shared, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvelastic.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVELASTIC_SHARED_DIR": str(shared)})


@pytest.fixture
def engine(tmp_path):
    """A live engine process, joined to the account of GPU-sizes with 1 GiB held."""
    process = subprocess.Popen([sys.executable, "-c", ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "KVELASTIC_SHARED_DIR": str(tmp_path)})
    assert process.stdout.readline().strip() == "joined"
    yield tmp_path, process
    if process.poll() is None:
        process.kill()
    process.wait(30)


@pytest.mark.parametrize("size", HUGE)
def test_the_cli_refuses_a_budget_or_limit_the_account_cannot_store(engine, size):
    shared, process = engine
    for args in (["budget", size], ["limit", "engine", size], ["limit", "engine", "--min", size]):
        done = _cli(shared, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "larger than any size kvelastic can hold" in done.stderr and "Traceback" not in done.stderr
    status = _cli(shared, "status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr  # readable: not exit 6
    (account,) = json.loads(status.stdout)["accounts"]
    assert account["budget_bytes"] == 40 * GIB and account["members"][0]["max_bytes"] == 8 * GIB
    process.stdin.close()
    assert process.stdout.readline().strip() == "ticked" and process.wait(30) == 0


@pytest.mark.parametrize("variable", ["KVELASTIC_SHARED_BUDGET", "KVELASTIC_LIMIT", "KVELASTIC_MIN",
                                      "KVELASTIC_VIRTUAL_BYTES"])
def test_a_size_setting_the_account_cannot_store_is_refused_naming_the_variable(variable):
    with pytest.raises(ConfigError, match=f"{variable}='5000000TiB' is larger than any size kvelastic can hold"):
        Settings.from_env({variable: "5000000TiB"})


def test_the_largest_size_is_one_shared_limit_readers_and_writers_agree_on(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    assert parse_size(str(MAX_BYTES)) == MAX_BYTES
    with pytest.raises(ConfigError):
        parse_size(str(MAX_BYTES + 1))
    with pytest.raises(BadLimits, match="at most"):
        SharedAccount.open(GPU, MAX_BYTES + 1)
    with SharedAccount.open(GPU, MAX_BYTES) as account:  # the largest storable budget reads back
        assert account.budget == MAX_BYTES
        member = account.join("engine")
        for bad in (lambda: account.set_budget(MAX_BYTES + 1), lambda: account.set_budget(1 << 64),
                    lambda: account.set_limits("engine", max_bytes=1 << 63),
                    lambda: account.set_limits("engine", min_bytes=1 << 64),
                    lambda: account.join("other", max_bytes=MAX_BYTES + 1)):
            with pytest.raises(BadLimits):
                bad()
        member.adopt(MAX_BYTES)
        with pytest.raises(BadLimits, match="cannot be stored"):
            member.adopt(1)  # what it holds could not be written: nothing is
        assert account.budget == MAX_BYTES and account.member("engine").mapped_bytes == MAX_BYTES


def test_the_launcher_refuses_huge_budgets_and_limits_before_anything_starts():
    for args in (["--budget", "5000000TiB"], ["--model", "m", "--port", "8001", "--limit", str(1 << 64)],
                 ["--model", "m", "--port", "8001", "--min", "5000000TiB"]):
        done = subprocess.run([sys.executable, "-m", "kvelastic.launcher.command", "--dry-run", *args], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and "larger than any size kvelastic can hold" in done.stderr, done.stderr
