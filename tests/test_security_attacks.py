"""Attacks on the shared folder, each tried as a second local user (or a hostile file) would try it.

Each test does what the attack does and checks that it has no effect. The
first plants pickles and a symlink where a tensor-parallel engine's ranks could
look for each other (a folder named after the engine's process, whose pid and
start time are public): the ranks and the scheduler meet only on vLLM's calls,
so the test checks that such an engine opens none of it.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
import threading
from pathlib import Path

import pytest

from kvelastic.cluster import SharedAccount, account_path
from kvelastic.cluster.records import Header
from tests.other_user import (FORK, OTHER_UID, RunningAs, RunsCodeWhenUnpickled, as_user, cli_as,  # noqa: F401
                              env_with, needs_root, shared_root)

GPU = "GPU-attacked"
GIB = 1024**3
pytestmark = needs_root


def _victim_tries(*attempts) -> list[BaseException]:
    errors = []
    for attempt in attempts:
        try:
            attempt()
        except Exception as error:  # noqa: BLE001 - the test asserts what was refused, and how
            errors.append(error)
    return errors


# ------------------------------------------------------- 1. code execution
def _plant_engine_folder(folder: str, marker: str, target: str) -> str:
    os.makedirs(folder, exist_ok=True)
    Path(folder, "rank0.info").write_bytes(pickle.dumps(RunsCodeWhenUnpickled(marker)))
    Path(folder, "idle-000000000002-000000000002.cmd").write_bytes(pickle.dumps(RunsCodeWhenUnpickled(marker)))
    os.symlink(target, os.path.join(folder, "rank0.board"))
    return "planted"


def _engine_folder() -> Path:
    """A folder named after this process in the user's shared folder: its pid and start time are public."""
    from kvelastic.cluster.liveness import own_pid_namespace, process_start_time
    from kvelastic.shared.scope import current_scope

    return current_scope().path / f"engine-{own_pid_namespace()}-{os.getpid()}-{process_start_time(os.getpid())}"


def _tp_engine_step() -> set[int]:
    """A tensor-parallel engine of the victim's, a rank and its scheduler: described, one map sent with a step
    and confirmed on its report. The groups the scheduler holds as mapped."""
    from kvelastic.tp import rank_handover
    from kvelastic.tp.rank_info import decode_info
    from kvelastic.tp.scheduler_side import RankConnection
    from kvelastic.tp.step_report import StepReport
    from kvelastic.tp.worker_side import start_rank
    from tests.kv_fixtures import build_cache

    pool, _, cache = build_cache()
    worker = start_rank(cache, 0, 1, None, None)
    try:
        connection = RankConnection([decode_info(rank_handover.describe(None), "rank 0's reply")])
        connection.mapper.request_map([1])
        plan = connection.mapper.take_plan()
        worker.before_step(plan)
        worker.after_step(plan)
        connection.mapper.adopt(StepReport((worker.take_report(),)))
        return set(connection.mapper.mapped_groups)
    finally:
        worker.close()
        pool.close()
        rank_handover.forget()


def test_attack_1_a_planted_engine_folder_runs_no_code_and_overwrites_nothing(shared_root):
    marker, target = shared_root / "code-ran", shared_root / "precious"
    target.write_bytes(b"precious")
    folder = _engine_folder()
    assert as_user(_plant_engine_folder, str(folder), str(marker), str(target)) == "planted"
    planted = sorted(os.listdir(folder))
    assert 1 in _tp_engine_step(), "the engine could not serve beside the planted folder"
    assert not marker.exists(), "the engine ran another user's pickle"
    assert target.read_bytes() == b"precious", "a board was written through a planted symlink"
    assert sorted(os.listdir(folder)) == planted and os.stat(folder).st_uid == OTHER_UID


def test_attack_1_once_the_users_folder_exists_nobody_else_can_put_anything_in_it(shared_root):
    folder = _engine_folder()
    with SharedAccount.open(GPU, GIB):  # the user's folder now exists, mode 0700
        result = as_user(_plant_engine_folder, str(folder), str(shared_root / "m"), str(shared_root / "t"))
    assert result[0] == "error" and "PermissionError" in result[1]
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


# ----------------------------------------------------- 2. freezing engines
def _lock_as_other(path: str, ready, done, got) -> None:
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        got.value = 1
    except OSError:
        got.value = -1
    ready.set()
    done.wait(60)


def _become_other_and(target, *args) -> None:
    os.setgroups([])
    os.setgid(OTHER_UID)
    os.setuid(OTHER_UID)
    target(*args)


def test_attack_2_another_user_cannot_freeze_the_engines_with_a_lock(shared_root):
    account = SharedAccount.open(GPU, GIB)
    member = account.join("engine")
    ready, done, got = FORK.Event(), FORK.Event(), FORK.Value("i", 0)
    holder = FORK.Process(target=_become_other_and, args=(_lock_as_other, str(account.path), ready, done, got))
    holder.start()
    try:
        assert ready.wait(30)
        finished = threading.Event()
        worker = threading.Thread(target=lambda: (member.acquire(1024), finished.set()), daemon=True)
        worker.start()
        assert finished.wait(3), "a lock taken by another user stalled the engine"
        assert got.value == -1  # it could not even open the account
    finally:
        done.set()
        holder.join(30)
        account.close()


# ------------------------------------------------- 3. writes without permission
def _engine_of_this_user(gpu: str, read_only: bool) -> SharedAccount:
    """What an engine of the calling user leaves: an account with a member "small" (file made 0400)."""
    account = SharedAccount.open(gpu, 40 * GIB)
    account.join("small", max_bytes=8 * GIB)
    if read_only:
        os.chmod(account.path, 0o400)
    return account


def test_attack_3_limit_and_budget_by_another_user_fail_loudly_and_change_nothing(shared_root):
    with SharedAccount.open(GPU, 40 * GIB) as account:
        small = account.join("small", max_bytes=8 * GIB)
        for args in (["limit", "small", "1GiB"], ["budget", "1GiB"]):
            code, out, err = cli_as(OTHER_UID, args, env_with(shared_root))
            assert code != 0, f"{args}: exit 0 although nothing could change ({out})"
            assert "no account" in err and "per user" in err
        assert small.limits() == (0, 8 * GIB) and account.budget == 40 * GIB


def test_attack_3_a_read_only_account_is_an_error_with_exit_5_not_a_silent_success(shared_root):
    env = env_with(shared_root)
    with RunningAs(OTHER_UID, _engine_of_this_user, GPU, True):
        for args in (["limit", "small", "1GiB"], ["budget", "1GiB"]):
            code, out, err = cli_as(OTHER_UID, args, env)
            assert code == 5, (args, code, out, err)
            assert "nothing changed" in err and "permission denied" in err and "1.00 GiB" not in out
        code, out, _ = cli_as(OTHER_UID, ["status", "--json"], env)
        (acct,) = json.loads(out)["accounts"]
        assert acct["budget_bytes"] == 40 * GIB and acct["members"][0]["max_bytes"] == 8 * GIB


# ----------------------------------------------- 4. squatting the account path
def _squat(path: str, how: str, target: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if how == "symlink":
        os.symlink(target, path)
    else:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
        os.fchmod(fd, 0o666)
        os.close(fd)
    return "squatted"


def _forge_budget(path: str, header: bytes) -> str:
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as error:
        return f"refused: {error}"
    os.pwrite(fd, header, 0)
    os.close(fd)
    return "wrote"


@pytest.mark.parametrize("how", ["world-writable file", "symlink"])
def test_attack_4_a_squatted_account_path_is_refused_never_used_or_written_through(shared_root, how):
    target = shared_root / "victims-file"
    target.write_bytes(b"")
    target.chmod(0o600)
    path = account_path(GPU)
    assert as_user(_squat, str(path), how, str(target)) == "squatted"
    errors = _victim_tries(lambda: SharedAccount.open(GPU, 1000).join("victim"))
    forged = Header(budget_bytes=1, gpu_id=GPU, created=0.0).pack()
    as_user(_forge_budget, str(path), forged)
    assert target.read_bytes() == b"", "the account was created through another user's symlink"
    if not errors:  # the victim used the squatted file: the attacker must not have changed its budget
        with SharedAccount.open(GPU, 1000) as account:
            assert account.budget == 1000, "another user set the victim's budget"
    from kvelastic.shared.errors import UnsafeSharedPath

    assert len(errors) == 1 and isinstance(errors[0], UnsafeSharedPath), errors


def test_attack_4_an_engine_says_when_other_users_run_kvelastic_beside_it(shared_root, kv_log):
    from tests.test_cluster_link import PAGE, engine

    as_user(lambda: SharedAccount.open(GPU, 1000).close())  # another user's engine on this machine
    pool, *_, link = engine("mine", budget=8 * PAGE, limit=None)
    try:
        text = kv_log.text
        assert f"kvelastic-u{OTHER_UID}" in text and "not counted" in text
    finally:
        link.leave()
        pool.close()
