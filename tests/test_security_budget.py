"""A newcomer's ``KVELASTIC_SHARED_BUDGET``: it never resets the budget of a live account.

docs/multi-instance.md: "The first process to create a GPU's account sets its
budget; later ones keep it. Change it at run time with ``kvelastic budget``."
A later engine started with its own ``KVELASTIC_SHARED_BUDGET`` did set it: 40 GiB
became 8 GiB under a 30 GiB holder. Now it applies only to an account no live
engine is a member of (one that engines which are gone left behind).
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvelastic.cluster import SharedAccount
from kvelastic.cluster.device import device_identity
from kvelastic.pool import HostBackend
from tests.test_cluster_link import engine

GIB = 1024**3
HOLDER = """
import sys
from kvelastic.cluster import SharedAccount
account = SharedAccount.open(sys.argv[1], 40 * 1024**3)
member = account.join("holder")
assert member.acquire(30 * 1024**3)
print("holding", flush=True)
sys.stdin.read()
"""


def _holder(shared, gpu: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, gpu], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "KVELASTIC_SHARED_DIR": str(shared)})
    assert process.stdout.readline().strip() == "holding"
    return process


def test_a_later_engines_budget_does_not_reset_a_live_account(tmp_path, monkeypatch, kv_log):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    gpu = device_identity(HostBackend())[0]  # the account the test engine joins
    holder = _holder(tmp_path, gpu)
    try:
        pool, *_, link = engine("newcomer", budget=8 * GIB, limit=None)  # KVELASTIC_SHARED_BUDGET=8GiB
        try:
            assert link.membership.attached
            assert link.account.budget == 40 * GIB, "a newcomer's KVELASTIC_SHARED_BUDGET reset the live budget"
            assert "KVELASTIC_SHARED_BUDGET=8.00 GiB is not applied" in kv_log.text
            assert "kvelastic budget" in kv_log.text
        finally:
            link.leave()
            pool.close()
    finally:
        holder.stdin.close()
        holder.wait(30)


def test_an_account_its_engines_left_behind_takes_the_new_budget(tmp_path, monkeypatch, kv_log):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    gpu = device_identity(HostBackend())[0]
    holder = _holder(tmp_path, gpu)
    holder.kill()  # the engines that set 40 GiB are gone; their account stays in /dev/shm
    holder.wait(30)
    pool, *_, link = engine("restarted", budget=8 * GIB, limit=None)
    try:
        assert link.account.budget == 8 * GIB
        assert "not applied" not in kv_log.text
    finally:
        link.leave()
        pool.close()
    with SharedAccount.open(gpu, GIB) as account:
        assert account.budget == 8 * GIB
