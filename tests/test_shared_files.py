"""The safe-file layer every shared file goes through (``kvelastic.shared``), and who shares what.

Real folders, files, FIFOs and symlinks; a second and third uid where the
trust model is about users (a group that shares one account, a user outside
it).
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
import time

import pytest

from kvelastic.cluster import SharedAccount
from kvelastic.shared import bounded_json
from kvelastic.shared.errors import BadSharedData, LockBusy, UnsafeSharedPath
from kvelastic.shared.files import SafeDir
from kvelastic.shared.locks import locked
from kvelastic.shared.scope import Scope, current_scope
from tests.other_user import OTHER_UID, THIRD_UID, RunningAs, cli_as, env_with, needs_root, shared_root  # noqa: F401

GIB = 1024**3


@pytest.fixture
def folder(tmp_path):
    scope = Scope(tmp_path, os.geteuid())
    with SafeDir.open(scope.path, scope, create=True) as directory:
        yield directory


def test_the_scope_folder_is_created_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        scope = Scope(tmp_path, os.geteuid())
        SafeDir.open(scope.path, scope, create=True).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(scope.path.stat().st_mode) == 0o700


@pytest.mark.parametrize("make", ["symlink", "file", "open mode"])
def test_a_scope_folder_that_is_not_a_private_directory_is_refused_every_time(tmp_path, make):
    scope = Scope(tmp_path, os.geteuid())
    if make == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        scope.path.symlink_to(tmp_path / "elsewhere")
    elif make == "file":
        scope.path.write_text("")
    else:
        SafeDir.open(scope.path, scope, create=True).close()
        scope.path.chmod(0o755)  # checked on every open, not only on creation
    with pytest.raises(UnsafeSharedPath):
        SafeDir.open(scope.path, scope, create=True)


def test_files_are_read_without_following_links_blocking_on_fifos_or_reading_without_bound(folder):
    (folder.path / "target").write_bytes(b"secret")
    (folder.path / "link").symlink_to(folder.path / "target")
    os.mkfifo(folder.path / "fifo")
    (folder.path / "big").write_bytes(b"x" * 2048)
    with pytest.raises(UnsafeSharedPath, match="symlink"):
        folder.read_bytes("link", 100)
    started = time.monotonic()
    with pytest.raises(UnsafeSharedPath, match="not a regular file"):
        folder.read_bytes("fifo", 100)
    assert time.monotonic() - started < 1
    with pytest.raises(BadSharedData, match="2048 bytes"):
        folder.read_bytes("big", 1024)
    assert folder.read_bytes("big", 4096) == b"x" * 2048


def test_writes_are_whole_never_clobber_and_never_go_through_a_link(folder):
    (folder.path / "target").write_bytes(b"keep")
    (folder.path / "link").symlink_to(folder.path / "target")
    folder.write_atomic("link", b"new")  # replaces the link itself, never writes its target
    assert (folder.path / "target").read_bytes() == b"keep" and (folder.path / "link").read_bytes() == b"new"
    assert folder.create_new("fresh", b"one") and not folder.create_new("fresh", b"two")
    assert (folder.path / "fresh").read_bytes() == b"one"
    assert not [n for n in os.listdir(folder.path) if n.startswith(".tmp-")]


@needs_root
def test_another_users_file_is_neither_read_nor_removed(folder):
    (folder.path / "theirs").write_bytes(b"{}")
    os.chown(folder.path / "theirs", OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeSharedPath, match=f"uid {OTHER_UID}"):
        folder.read_bytes("theirs", 100)
    assert not folder.unlink_owned("theirs") and (folder.path / "theirs").exists()


@pytest.mark.parametrize("text, complaint", [
    (b"[" * 9 + b"]" * 9, "deeper"), (b'{"a": NaN}', "NaN"), (b'{"a": -Infinity}', "Infinity"),
    (b'{"a": 1e400}', "range"), (b'{"a": 99999999999999999999999}', "range"), (b"\xff", "UTF-8"),
    (b"{", "not valid JSON")])
def test_bounded_json_refuses_what_kvelastic_never_writes(text, complaint):
    with pytest.raises(BadSharedData, match=complaint):
        bounded_json.loads(text, "snapshot")


def test_bounded_json_round_trips_and_checks_a_schema():
    record = bounded_json.loads(bounded_json.dumps({"name": "a", "n": 3, "t": 1.5}), "x")
    assert bounded_json.expect(record, {"name": str, "n": int, "t": (int, float)}, "x") is record
    with pytest.raises(BadSharedData, match="n must be int"):
        bounded_json.expect({"name": "a", "n": True}, {"name": str, "n": int}, "x")
    with pytest.raises(ValueError):
        bounded_json.dumps({"a": float("nan")})


def test_a_lock_held_elsewhere_costs_a_deadline_not_a_stall(folder):
    fd = folder.open_file("lockme", os.O_RDWR, create=True)
    other = os.open(folder.path / "lockme", os.O_RDONLY)
    fcntl.flock(other, fcntl.LOCK_SH)  # another open file description: as another process would
    started = time.monotonic()
    with pytest.raises(LockBusy):
        with locked(threading.Lock(), fd, 0.005, exclusive=True, what="lockme"):
            pass
    assert time.monotonic() - started < 0.1
    fcntl.flock(other, fcntl.LOCK_UN)
    with locked(threading.Lock(), fd, 0.005, exclusive=True, what="lockme"):
        pass
    os.close(fd)
    os.close(other)


def test_the_shared_dir_setting_is_read_in_one_place_and_validated(tmp_path):
    assert current_scope(environ={"KVELASTIC_SHARED_DIR": str(tmp_path)}).path == tmp_path / f"kvelastic-u{os.geteuid()}"
    from kvelastic.errors import ConfigError

    with pytest.raises(ConfigError, match="not a member"):
        current_scope(environ={"KVELASTIC_SHARED_DIR": str(tmp_path), "KVELASTIC_SHARED_GROUP": "54399"})


# -------------------------------------------------------------- group scope
GROUP = 54330


def _group_engine(gpu: str) -> SharedAccount:
    account = SharedAccount.open(gpu, 40 * GIB)
    account.join("team-engine", max_bytes=8 * GIB)
    return account


@needs_root
def test_a_group_shares_one_account_and_a_user_outside_it_sees_nothing(shared_root):
    team = env_with(shared_root, KVELASTIC_SHARED_GROUP=str(GROUP))
    os.environ.update(team)  # for the forked engine below
    # The test's uids are in no user database, so none can show it is a member: root makes the folder,
    # as an administrator would (a member the database lists may make it too).
    SafeDir.open(shared_root / f"kvelastic-g{GROUP}", Scope(shared_root, os.geteuid(), GROUP), create=True).close()
    try:
        with RunningAs(OTHER_UID, _group_engine, "GPU-team", groups=(GROUP,)):
            folder = shared_root / f"kvelastic-g{GROUP}"
            assert stat.S_IMODE(folder.stat().st_mode) == 0o2770 and folder.stat().st_gid == GROUP
            code, out, err = cli_as(THIRD_UID, ["limit", "team-engine", "4GiB"], team, groups=(GROUP,))
            assert code == 0, err  # a member of the group steers the other member's engine
            code, out, err = cli_as(THIRD_UID, ["status"], team, groups=(GROUP,))
            assert code == 0 and "team-engine" in out and "4.00 GiB" in out
            code, _, err = cli_as(THIRD_UID, ["reset", "GPU-team", "--force"], team, groups=(GROUP,))
            assert code == 5 and "only its owner" in err  # but removes only files it owns
            code, _, err = cli_as(THIRD_UID, ["status"], team)  # not in the group
            assert code == 2 and "not a member" in err
            code, out, err = cli_as(THIRD_UID, ["status"], env_with(shared_root))  # its own scope: empty
            assert code == 4 and "team-engine" not in out
    finally:
        os.environ.pop("KVELASTIC_SHARED_GROUP", None)
