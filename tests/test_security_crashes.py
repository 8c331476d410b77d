"""Crashes, full file systems and bad files.

A SIGKILL before any write of account creation or of a transaction, ENOSPC at
any write (a tiny tmpfs where it can be mounted, injected otherwise), header
fields out of range, a relative or missing ``KVELASTIC_SHARED_DIR``, engines
killed without cleaning up: the account stays usable (or is reported, and can
be reset), and nothing is left behind for good.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvelastic.cluster import AccountCorrupt, SharedAccount, account_path
from kvelastic.cluster.records import Header, MemberRecord, record_offset
from kvelastic.errors import ConfigError
from tests.tiny_tmpfs import mounted_tiny_tmpfs

FORK = multiprocessing.get_context("fork")
GPU = "GPU-crash"
MUTATIONS = ("write", "pwrite", "ftruncate", "posix_fallocate", "link", "rename", "replace", "unlink", "fchmod",
             "fchown", "mkdir")


@pytest.fixture
def shared(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    return tmp_path


def _hook_mutations(at: int, action) -> dict:
    """Make the ``at``-th call of any file-changing ``os`` function run ``action`` first; returns the originals."""
    calls = itertools.count(1)
    originals = {name: getattr(os, name) for name in MUTATIONS if hasattr(os, name)}

    def hooked(real):
        def call(*args, **kwargs):
            if next(calls) == at:
                action()
            return real(*args, **kwargs)
        return call

    for name, real in originals.items():
        setattr(os, name, hooked(real))
    return originals


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_during(at: int, work) -> None:
    _hook_mutations(at, _sigkill_self)
    work()
    os._exit(0)


def _crash_points(work) -> int:
    """Run ``work`` in a child killed before its 1st, 2nd, ... file change, until it finishes; yields nothing."""
    for at in itertools.count(1):
        child = FORK.Process(target=_die_during, args=(at, work))
        child.start()
        child.join(60)
        if child.exitcode == 0:
            return at - 1
        assert child.exitcode == -signal.SIGKILL, child.exitcode
        yield at


def _create() -> None:
    SharedAccount.open(GPU, 1000)


def test_a_sigkill_at_any_point_of_account_creation_leaves_no_account_or_a_whole_one(shared):
    points = 0
    for _ in _crash_points(_create):
        points += 1
        with SharedAccount.open(GPU, 1000) as account:  # never "bad magic", never a zero-filled file
            assert account.budget == 1000
            account.join("after-the-crash").leave()
        from kvelastic.shared.sweep import sweep_scope

        sweep_scope()
        leftovers = [p.name for p in account.path.parent.iterdir() if p.name != account.path.name]
        assert leftovers == [], f"the crashed creator's files stay: {leftovers}"
        account.path.unlink()
    assert points >= 3  # temporary file, its content, the link into place (at least)


def _churn_then_die(path: str) -> None:
    account = SharedAccount.attach(path)
    me = account.join("doomed", min_bytes=50)
    assert me.acquire(300)
    me.report(cached_bytes=100)
    me.release(100)
    account.set_limits("doomed", max_bytes=400)
    second = account.join("doomed-too")
    second.acquire(100)
    second.leave()
    me.leave()


def test_a_sigkill_between_the_writes_of_a_transaction_leaves_a_consistent_account(shared):
    with SharedAccount.open(GPU, 1000) as account:
        mine = account.join("survivor")
        assert mine.acquire(200)
        for _ in _crash_points(lambda: _churn_then_die(str(account.path))):
            members = {m.name: m for m in account.members()}  # the dead child's records are pruned
            assert set(members) == {"survivor"} and members["survivor"].mapped_bytes == 200
            assert mine.acquire(800) and not mine.acquire(1)  # its bytes all came back
            mine.release(800)


def _enospc() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("at", range(1, 9))
def test_enospc_at_any_write_of_account_creation_never_leaves_a_broken_account(shared, at):
    originals = _hook_mutations(at, _enospc)
    try:
        SharedAccount.open(GPU, 1000).close()
        failed = None
    except OSError as error:
        failed = error
    except Exception as error:  # noqa: BLE001 - kvelastic's NoSpace is asserted below
        failed = error
    finally:
        for name, real in originals.items():
            setattr(os, name, real)
    if failed is not None:
        assert "space" in str(failed).lower(), failed
    with SharedAccount.open(GPU, 1000) as account:  # the next try works: nothing half-written is in the way
        assert account.budget == 1000


# ----------------------------------------------------------- a tiny tmpfs
@pytest.fixture
def tiny_tmpfs():
    with mounted_tiny_tmpfs("kvelastic-tiny-", without="; the injected-ENOSPC tests cover it") as where:
        yield where


def test_a_full_tmpfs_is_a_clear_error_at_account_creation(tiny_tmpfs, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tiny_tmpfs))
    filler = tiny_tmpfs / "filler"
    filler.write_bytes(b"x" * 60 * 1024)
    with pytest.raises(Exception, match="(?i)no space"):
        SharedAccount.open(GPU, 1000)
    filler.unlink()
    with SharedAccount.open(GPU, 1000) as account:
        assert account.budget == 1000


# ------------------------------------------------------------ bad headers
def _plant_account(header: Header) -> Path:
    SharedAccount.open("other", 1).close()  # the user's folder
    path = account_path(GPU)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.pwrite(fd, header.pack(), 0)
    os.ftruncate(fd, header.file_size)
    os.close(fd)
    return path


def test_a_huge_slot_count_is_refused_not_read(shared):
    _plant_account(Header(budget_bytes=1000, gpu_id=GPU, created=time.time(), slots=1 << 20))
    started = time.monotonic()
    with pytest.raises(AccountCorrupt, match="slots"):
        SharedAccount.open(GPU, 1000)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("field, value, complaint", [("heartbeat", math.nan, "time"), ("pid", -5, "pid"),
                                                     ("wanted_at", math.inf, "time")])
def test_record_fields_out_of_range_make_the_account_corrupt(shared, field, value, complaint):
    path = _plant_account(Header(budget_bytes=1000, gpu_id=GPU, created=time.time()))
    record = MemberRecord(name="forged", pid=os.getpid(), slot=3)
    setattr(record, field, value)
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, record.pack(), record_offset(3))
    os.close(fd)
    with pytest.raises(AccountCorrupt, match=complaint):
        SharedAccount.open(GPU, 1000)


# ------------------------------------------------------ KVELASTIC_SHARED_DIR
@pytest.mark.parametrize("value, complaint", [("relative/dir", "absolute"), ("/no/such/kvelastic-dir", "existing")])
def test_a_relative_or_missing_shared_dir_is_a_clear_error_not_a_new_folder(tmp_path, monkeypatch, value,
                                                                              complaint):
    from kvelastic.settings import Settings

    with pytest.raises(ConfigError, match=f"KVELASTIC_SHARED_DIR.*{complaint}"):
        Settings.from_env({"KVELASTIC_SHARED_DIR": value})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", value)
    with pytest.raises(ConfigError, match="KVELASTIC_SHARED_DIR"):
        SharedAccount.open(GPU, 1000)
    result = subprocess.run([sys.executable, "-m", "kvelastic.cli", "status"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "KVELASTIC_SHARED_DIR": value}, cwd=tmp_path)
    assert result.returncode == 2 and "KVELASTIC_SHARED_DIR" in result.stderr
    assert list(tmp_path.iterdir()) == [] and not Path(value).exists()


# ------------------------------------------------------------- dead engines
ENGINE = """
import sys
from kvelastic.metrics.metrics import StatsPublisher
from kvelastic.shared.names import temp_name
from kvelastic.shared.scope import current_scope
StatsPublisher("doomed").publish({"mapped_bytes": 1})
half_written = current_scope().path / temp_name()  # a write SIGKILL stops before its rename
half_written.write_text("doomed")
print(half_written, flush=True)
sys.stdin.read()
"""


def test_files_of_sigkilled_engines_are_removed_by_status(shared):
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "KVELASTIC_SHARED_DIR": str(shared)})
    half_written = Path(engine.stdout.readline().strip())
    engine.kill()
    engine.wait(30)
    files = [p for p in half_written.parent.iterdir() if p.is_file() and "doomed" in p.read_text()]
    assert half_written in files and len(files) == 2  # its temporary file and its metrics snapshot
    subprocess.run([sys.executable, "-m", "kvelastic.cli", "status"], capture_output=True, timeout=60,
                   env={**os.environ, "KVELASTIC_SHARED_DIR": str(shared)})
    assert not any(p.exists() for p in files), "a dead engine's files outlived it"


# ------------------------------------------------ corrupt accounts, reset
def _cli(shared, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvelastic.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVELASTIC_SHARED_DIR": str(shared)})


def test_a_corrupt_account_is_reported_by_status_and_reset_by_its_owner(shared):
    with SharedAccount.open(GPU, 1000) as account:
        path = account.path
    path.write_bytes(bytes(path.stat().st_size))  # what a crash of the old creation left: zeros
    status = _cli(shared, "status")
    assert status.returncode == 6, status.stderr
    assert f"GPU {GPU}: cannot read its account" in status.stdout and f"kvelastic reset {GPU}" in status.stdout
    shown = json.loads(_cli(shared, "status", "--json").stdout)["accounts"]
    assert shown[0]["gpu"] == GPU and "bad magic" in shown[0]["error"]
    reset = _cli(shared, "reset", GPU)
    assert reset.returncode == 0 and "removed" in reset.stdout and not path.exists()
    with SharedAccount.open(GPU, 1000) as account:
        member = account.join("live")
        refused = _cli(shared, "reset", GPU)
        assert refused.returncode == 2 and "--force" in refused.stderr and path.exists()
        assert _cli(shared, "reset", GPU, "--force").returncode == 0 and not path.exists()
        member.leave()
    assert _cli(shared, "reset", GPU).returncode == 4
