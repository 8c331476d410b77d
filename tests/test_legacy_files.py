"""What an engine says about kvelastic files beside its scope's folder, on real files in a real directory.

An older kvelastic kept a GPU's account straight in the shared directory as
``kvelastic-<gpu id>`` (``kvelastic-gpu-<uuid>`` on a GPU). Such a file of this
user is a leftover (or the account of an engine of that version): the engine
says so and how to remove it, and never calls it another user's folder. Only
folders named exactly ``kvelastic-u<uid>`` / ``kvelastic-g<gid>`` are other
scopes.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from kvelastic.shared.legacy import legacy_account, legacy_account_name
from kvelastic.shared.scope import current_scope, other_scopes
from tests.other_user import OTHER_UID, needs_root

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")


@pytest.fixture
def shared(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "shm"
    root.mkdir(mode=0o1777)
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(root))
    monkeypatch.delenv("KVELASTIC_SHARED_GROUP", raising=False)
    return root


def this_hosts_legacy_file(root: Path) -> Path:
    """Where the older kvelastic kept the account of the host backend's 'GPU' (this machine)."""
    return root / legacy_account_name(f"host-{socket.gethostname()}")


def join(name: str):
    from tests.test_cluster_link import PAGE, engine

    pool, *_, link = engine(name, budget=8 * PAGE, limit=None)
    return pool, link


def warnings_of(kv_log) -> list[str]:
    """kvelastic's warnings, each once (the records reach the capture through more than one handler)."""
    return sorted({r.getMessage() for r in kv_log.records if r.name == "vllm.kvelastic" and r.levelname == "WARNING"})


def test_a_leftover_account_of_this_user_is_named_as_such_with_a_command_that_removes_it(shared, kv_log):
    leftover = this_hosts_legacy_file(shared)
    leftover.write_bytes(b"KVELASTIC-ACCOUNT v1\0" + bytes(200))  # what that version left: any content
    (shared / "kvelastic-gpu-dd696ca8-39c7-d509").write_bytes(b"x")  # a GPU's, as the H100 run found one
    pool, link = join("after-upgrade")
    try:
        said = [w for w in warnings_of(kv_log) if str(leftover) in w]
        assert len(said) == 1, warnings_of(kv_log)
        assert "older kvelastic" in said[0] and "not counted" in said[0]
        assert not any("other users'" in w for w in warnings_of(kv_log)), warnings_of(kv_log)
        command = said[0].split("remove it with: ", 1)[1]
        subprocess.run(shlex.split(command), check=True)  # the command the engine gave does remove it
        assert not leftover.exists()
        assert any(p.name == current_scope().dir_name for p in shared.iterdir()), "the engine joined its own folder"
    finally:
        link.leave()
        pool.close()


def test_no_leftover_no_word_about_one(shared, kv_log):
    pool, link = join("fresh")
    try:
        assert warnings_of(kv_log) == []
    finally:
        link.leave()
        pool.close()


def test_only_folders_named_exactly_like_a_scope_are_other_scopes(shared):
    scope = current_scope()
    for folder in (scope.dir_name, "kvelastic-u54321", "kvelastic-g12", "kvelastic-gpu-abc", "kvelastic-u7x"):
        (shared / folder).mkdir()
    for file in ("kvelastic-g77", "kvelastic-gpu-0c1d-2e3f", "kvelastic-host-box", "kvelastic-stats-1-0.json"):
        (shared / file).write_text("x")
    os.symlink(shared / "kvelastic-g12", shared / "kvelastic-u999")
    assert other_scopes(scope) == ["kvelastic-g12", "kvelastic-u54321"]


def test_a_link_or_folder_with_the_legacy_name_is_no_legacy_account(shared, tmp_path):
    scope = current_scope()
    target = tmp_path / "elsewhere"
    target.write_text("x")
    os.symlink(target, shared / legacy_account_name("gpu-linked"))
    (shared / legacy_account_name("gpu-folder")).mkdir()
    (shared / legacy_account_name("gpu-real")).write_text("x")
    assert legacy_account(scope, "gpu-linked") is None
    assert legacy_account(scope, "gpu-folder") is None
    assert legacy_account(scope, "gpu-absent") is None
    found = legacy_account(scope, "gpu-real")
    assert found is not None and found.uid == os.geteuid() and found.path == shared / "kvelastic-gpu-real"


@needs_root
def test_another_users_leftover_is_named_with_its_owner_and_no_command_this_user_cannot_run(shared, kv_log):
    leftover = this_hosts_legacy_file(shared)
    leftover.write_bytes(b"x")
    os.chown(leftover, OTHER_UID, OTHER_UID)
    pool, link = join("beside-an-old-one")
    try:
        said = [w for w in warnings_of(kv_log) if str(leftover) in w]
        assert len(said) == 1 and "older kvelastic" in said[0], warnings_of(kv_log)
        assert f"belongs to uid {OTHER_UID}" in said[0] and "rm " not in said[0]
        assert leftover.exists()
    finally:
        link.leave()
        pool.close()
