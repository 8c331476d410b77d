"""A dead container's record: records of another pid namespace hold a lease.

A record of another pid namespace cannot be checked through ``/proc``; it was
treated as alive forever, so an engine restarted in a new container under the
same name stopped at start-up with ``NameInUse`` until someone ran ``kvelastic
reset --force``. Now a silent one is pruned when its lease lapses, and a live one,
which heartbeats four times a second, never is. Real pid namespaces (``unshare``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvelastic.cluster import NameInUse, SharedAccount

GPU = "GPU-lease"
LEASE = 1.5  # the test's own lease, so it need not wait LEASE_S
CONTAINER = """
import sys, time
from kvelastic.cluster import SharedAccount
account = SharedAccount.open(sys.argv[1], 1000)
member = account.join("model-a")
assert member.acquire(600)
print("joined", flush=True)
for _ in range(int(sys.argv[2])):
    time.sleep(0.25)
    member.tick(cached_bytes=0)  # what an engine's upkeep does four times a second
print("ticked", flush=True)
sys.stdin.read()
"""


def _unshare_problem() -> str | None:
    tool = shutil.which("unshare")
    if tool is None:
        return "no unshare command"
    probe = subprocess.run([tool, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare --pid --fork --mount-proc fails here: {probe.stderr.strip()}"


pytestmark = pytest.mark.skipif(_unshare_problem() is not None, reason=str(_unshare_problem()))


def _container(shared, ticks: int) -> subprocess.Popen:
    """A process in a pid namespace of its own (a container sharing /dev/shm), joined as model-a."""
    process = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c",
                                CONTAINER, GPU, str(ticks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "KVELASTIC_SHARED_DIR": str(shared)},
                               start_new_session=True)
    assert process.stdout.readline().strip() == "joined"
    return process


def _kill_container(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def test_a_dead_containers_record_frees_its_name_once_its_lease_lapses(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    container = _container(tmp_path, ticks=0)
    _kill_container(container)  # the container is gone: nothing of its namespace can prune its record
    with SharedAccount.open(GPU, 1000) as account:
        account.lease_s = LEASE
        with pytest.raises(NameInUse, match="another pid namespace.*free once it has been silent"):
            account.join("model-a")  # the restarted engine, in this namespace, right away
        assert not account.join("other").acquire(401)  # its 600 bytes still count while the lease holds
        deadline = time.monotonic() + 10
        while True:
            try:
                restarted = account.join("model-a")
                break
            except NameInUse:
                assert time.monotonic() < deadline, "the dead container's record was never pruned"
                time.sleep(0.1)
        assert {m.name for m in account.members()} == {"model-a", "other"}
        assert restarted.acquire(600)  # the dead record's bytes came back to the budget


def test_a_live_container_that_heartbeats_is_never_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    container = _container(tmp_path, ticks=16)  # four seconds of upkeep ticks, past the test's lease
    try:
        with SharedAccount.open(GPU, 1000) as account:
            account.lease_s = LEASE
            started = time.monotonic()
            while container.poll() is None and time.monotonic() - started < 3.5:
                assert [m.name for m in account.members()] == ["model-a"]
                with pytest.raises(NameInUse):
                    account.join("model-a")
                time.sleep(0.2)
            assert container.stdout.readline().strip() == "ticked"
    finally:
        _kill_container(container)


def test_the_default_lease_covers_many_missed_heartbeats():
    from kvelastic.cluster.account import LEASE_S
    from kvelastic.scheduler.upkeep import UpkeepThread

    assert LEASE_S >= 40 * UpkeepThread([], None).interval_s  # a slow tick or two never costs a live record
