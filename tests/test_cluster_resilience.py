"""Nothing that happens to the shared account stops vLLM's scheduler.

A lost record, a removed, replaced or corrupt file, another pid namespace, a
member stopped inside a transaction: the engine's real vLLM BlockPool keeps
answering (a scheduling miss at worst), the engine serves on its own limit,
and it rejoins the account when it can, handing it what it holds.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvelastic.cluster import SharedAccount
from kvelastic.cluster.records import MemberRecord
from tests.test_cluster_link import PAGE, engine

FORK = multiprocessing.get_context("fork")
GPU_OF_HOST_ENGINES = f"host-{os.uname().nodename}"


class _Engine(tuple):
    """The engine's parts; never shown in a failure report (its KV tensor's memory may be unmapped)."""

    def __repr__(self) -> str:
        return "<engine>"


@pytest.fixture
def one_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    pool, raw, cache, bp, queue, link = engine("a", budget=16 * PAGE, limit=12 * PAGE)
    link.membership.rejoin_period_s = 0.0  # rejoin on the next tick, not a second later
    yield _Engine((pool, raw, cache, bp, queue, link))
    link.leave()
    pool.close()


def _logged_once(kv_log, text: str) -> bool:
    """The record reaches two capturing handlers (the logger's and the root's): count records, not calls."""
    return len({id(r) for r in kv_log.records if text in r.getMessage()}) == 1


def _fresh_estimates(cache, queue) -> None:
    cache.forget_device_free()
    queue.room.forget()


def _listed(link) -> dict:
    with SharedAccount.open(link.gpu_id, 1) as account:
        return {m.name: m for m in account.members()}


def _free_the_record(path, name: str) -> None:
    """What a `kvelastic reset`, a buggy or hostile same-user process, or a wrong prune would do."""
    with SharedAccount.attach(path) as account, account._file.transaction() as snap:
        snap.write(MemberRecord(slot=snap.by_name(name).slot))


def _zero_the_header(path) -> None:
    with open(path, "r+b") as handle:
        handle.write(bytes(512))


@pytest.mark.parametrize("loss", ["record removed", "file removed", "file replaced", "header zeroed"])
def test_a_lost_account_never_reaches_the_scheduler_and_the_engine_rejoins(one_engine, loss, kv_log):
    pool, _, cache, bp, queue, link = one_engine
    held = bp.get_new_blocks(3 * 32)
    path = link.account.path
    if loss == "record removed":
        _free_the_record(path, "a")
    elif loss == "file removed":
        path.unlink()
    elif loss == "file replaced":
        SharedAccount.open("other", 1).close()
        os.replace(path.parent / "account-other", path)
    else:
        _zero_the_header(path)
    for _ in range(3):
        _fresh_estimates(cache, queue)
        assert bp.get_num_free_blocks() > 0  # vLLM's scheduler asks: it gets an answer, not an exception
    more = bp.get_new_blocks(2 * 32)  # serving on its own limit (12 pages) meanwhile
    assert pool.stats().mapped_bytes <= 12 * PAGE
    assert _logged_once(kv_log, "lost the shared KV account")
    if loss == "header zeroed":
        link.tick(queue, None)
        assert not link.membership.attached  # a corrupt account cannot be joined: `kvelastic reset` it
        assert pool.stats().limit_bytes == 12 * PAGE
        path.unlink()
    link.tick(queue, None)  # the reclaimer's tick rejoins
    assert link.membership.attached
    link.tick(queue, None)
    me = _listed(link)["a"]
    assert me.mapped_bytes == link.source.outstanding_bytes > 0  # the new record holds what the engine holds
    bp.free_blocks(held + more)


def test_a_member_stopped_inside_a_transaction_costs_the_others_a_miss_not_a_stall(one_engine, tmp_path):
    pool, _, cache, bp, queue, link = one_engine
    held = bp.get_new_blocks(32)
    stopped = FORK.Process(target=_stop_inside_a_transaction, args=(str(link.account.path),))
    stopped.start()
    try:
        _wait_for_lock_held(link.account.path)
        _fresh_estimates(cache, queue)
        started = time.monotonic()
        free = bp.get_num_free_blocks()
        answered = time.monotonic() - started
        assert answered < 0.5, f"the scheduler waited {answered:.2f}s for a stopped process"
        assert link.headroom() == 0  # no headroom this tick: nothing new is mapped
        assert bp.get_new_blocks(free) is not None  # what is already mapped is still handed out
        bp.free_blocks(held)  # the engine frees memory while the account is locked: counted later
        queue.set_idle()
        pool.collect()
        pool.trim_reserve(0)
        assert pool.stats().mapped_bytes < link.source.outstanding_bytes + PAGE
    finally:
        os.kill(stopped.pid, signal.SIGKILL)
        stopped.join(30)
    link.tick(queue, None)
    assert _listed(link)["a"].mapped_bytes == link.source.outstanding_bytes  # the deferred release settled


def _stop_inside_a_transaction(path: str) -> None:
    with SharedAccount.attach(path) as account, account._file.transaction():
        os.kill(os.getpid(), signal.SIGSTOP)  # a paused container, a debugger on a breakpoint


def _wait_for_lock_held(path) -> None:
    import fcntl

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return
        finally:
            os.close(fd)
        time.sleep(0.01)
    raise AssertionError("the stopped process never held the lock")


# ------------------------------------------------------------ pid namespaces
INNER = """
import sys
from kvelastic.cluster import SharedAccount
with SharedAccount.open(sys.argv[1], 1000) as account:
    member = account.join("inner")
    assert member.acquire(100)
    print(",".join(sorted(m.name for m in account.members())), flush=True)
    sys.stdin.read()
    member.leave()
"""


def _unshare_works() -> str | None:
    tool = shutil.which("unshare")
    if tool is None:
        return "no unshare command"
    probe = subprocess.run([tool, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare --pid --fork --mount-proc fails here: {probe.stderr.strip()}"


@pytest.mark.skipif(_unshare_works() is not None, reason=str(_unshare_works()))
def test_two_pid_namespaces_sharing_the_folder_never_prune_each_other(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    with SharedAccount.open("GPU-ns", 1000) as account:
        outer = account.join("outer")
        assert outer.acquire(200)
        inner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", INNER, "GPU-ns"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "KVELASTIC_SHARED_DIR": str(tmp_path)})
        try:
            seen_inside = inner.stdout.readline().strip()
            assert seen_inside == "inner,outer", inner.stderr.read() if not seen_inside else seen_inside
            for _ in range(3):
                members = {m.name: m for m in account.members()}
                assert set(members) == {"inner", "outer"}  # the inner pid means nothing here: never pruned
                time.sleep(0.25)
            assert members["inner"].pid_ns != members["outer"].pid_ns
            assert not outer.acquire(701)  # the inner member's 100 bytes still count
        finally:
            inner.communicate("", timeout=60)
        assert [m.name for m in account.members()] == ["outer"]


def test_status_and_reset_answer_while_a_stopped_member_holds_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(tmp_path)}
    with SharedAccount.open("GPU-wedged", 1000) as account:
        path = account.path
    stopped = FORK.Process(target=_stop_inside_a_transaction, args=(str(path),))
    stopped.start()
    try:
        _wait_for_lock_held(path)
        started = time.monotonic()
        status = subprocess.run([sys.executable, "-m", "kvelastic.cli", "status"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 6 and "try again" in status.stdout and "kvelastic reset" not in status.stdout
        refused = subprocess.run([sys.executable, "-m", "kvelastic.cli", "reset", "GPU-wedged"], env=env,
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "--force" in refused.stderr and path.exists()
        forced = subprocess.run([sys.executable, "-m", "kvelastic.cli", "reset", "GPU-wedged", "--force"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert forced.returncode == 0 and not path.exists()
        assert time.monotonic() - started < 30
    finally:
        os.kill(stopped.pid, signal.SIGKILL)
        stopped.join(30)
