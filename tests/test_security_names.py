"""Instance names: ASCII ``[A-Za-z0-9._-]{1,64}`` wherever one is accepted, and a
member known by its slot and process, never by its name.

A name of 40 accented letters is 80 UTF-8 bytes: stored cut to the record's 64,
it never matched itself again, so its engine was dropped and rejoined into a new
slot every second while the old slot stayed taken, until the account was full.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvelastic.cluster import ClusterError, SharedAccount
from kvelastic.cluster.records import record_offset
from kvelastic.errors import ConfigError
from kvelastic.settings import Settings

GPU = "GPU-names"
ACCENTED = "é" * 40  # 40 characters, 80 UTF-8 bytes
BAD_NAMES = [ACCENTED, "modèle", "模型", "", " ", "a" * 65, "a b", "name\n", "\x1b[31mred", "a/b", "ａｂ"]


@pytest.fixture
def shared(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name", [n for n in BAD_NAMES if n.strip() and n.strip() == n])  # values are stripped
def test_kvelastic_name_outside_ascii_is_refused_naming_the_variable(name):
    with pytest.raises(ConfigError, match="KVELASTIC_NAME=.*ASCII letters, digits"):
        Settings.from_env({"KVELASTIC_NAME": name})


@pytest.mark.parametrize("name", ["a", "small-8001", "Llama-3.1-8B_v2.q4", "x" * 64])
def test_valid_names_pass_everywhere(shared, name):
    assert Settings.from_env({"KVELASTIC_NAME": name}).name == name
    with SharedAccount.open(GPU, 1 << 30) as account:
        account.join(name).leave()


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_account_refuses_a_name_outside_the_alphabet(shared, name):
    with SharedAccount.open(GPU, 1 << 30) as account:
        with pytest.raises(ClusterError, match="ASCII") as refused:  # BadName
            account.join(name)
        assert type(refused.value).__name__ == "BadName"
        assert account.members() == []


def _engine_without_a_name(model: str):
    """An engine whose name comes from its model folder (KVELASTIC_NAME unset), joined to the account."""
    from tests.test_cluster_link import PAGE, engine

    pool, raw, cache, bp, queue, link = engine("placeholder", budget=64 * PAGE, limit=None)
    link.leave()
    from kvelastic.scheduler.cluster_link import ClusterLink, MemberTerms

    named = ClusterLink(cache, link.source, MemberTerms(model=model, shared_budget_bytes=64 * PAGE), None)
    return pool, queue, named


def test_an_engine_named_after_a_non_ascii_model_folder_keeps_one_slot(shared):
    model = "/models/" + "modèle-très-spécial-ünïcode-" * 3  # no KVELASTIC_NAME: the name comes from here
    pool, queue, link = _engine_without_a_name(model)
    link.membership.rejoin_period_s = 0.0  # each tick may rejoin at once, as a second of time would let it
    try:
        for _ in range(6):
            link.assess(queue, None)
        members = link.account.members()
        assert [m.name for m in members] == [link.name], "the engine leaked slots rejoining under a cut name"
        assert link.name.isascii() and link.name.startswith("modele-tres-special-unicode-")
        assert link.membership.attached
    finally:
        link.leave()
        pool.close()


def test_a_member_is_its_slot_and_process_not_its_name(shared):
    """Another writer of the scope rewriting the name field does not detach the member (nor free its slot)."""
    with SharedAccount.open(GPU, 1 << 30) as account:
        member = account.join("engine")
        assert member.acquire(4096)
        fd = os.open(account.path, os.O_RDWR)
        try:
            os.pwrite(fd, b"renamed".ljust(64, b"\0"), record_offset(0))
        finally:
            os.close(fd)
        tick = member.tick(cached_bytes=0)
        assert tick.budget_bytes == 1 << 30 and member.info().mapped_bytes == 4096
        assert [m.name for m in account.members()] == ["renamed"]


def test_the_cli_refuses_a_name_outside_the_alphabet_with_exit_2(shared):
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(shared)}
    with SharedAccount.open(GPU, 1 << 30) as account:
        account.join("engine")
        for name in (ACCENTED, "a" * 65, "\x1b[2J"):
            done = subprocess.run([sys.executable, "-m", "kvelastic.cli", "limit", name, "1GiB"], env=env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 2 and "ASCII letters" in done.stderr, done.stderr
            assert "\x1b" not in done.stderr and "Traceback" not in done.stderr


def test_the_launcher_derives_a_valid_name_from_a_non_ascii_model_folder_and_refuses_bad_ones(tmp_path):
    model = tmp_path / "模型"
    model.mkdir()
    launch = [sys.executable, "-m", "kvelastic.launcher.command", "--dry-run", "--json", "--model", str(model), "--port", "8001"]
    done = subprocess.run(launch, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (instance,) = json.loads(done.stdout)["instances"]
    assert instance["name"] == "model-8001" and instance["env"]["KVELASTIC_NAME"] == "model-8001"
    refused = subprocess.run(launch + ["--name", "modèle"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "ASCII letters" in refused.stderr, refused.stderr
    refused = subprocess.run(launch + ["--env", f"KVELASTIC_NAME={ACCENTED}"], capture_output=True, text=True,
                             timeout=60)  # the name is --name's, never the environment's
    assert refused.returncode == 2 and "env sets KVELASTIC_NAME" in refused.stderr, refused.stderr
    assert Path(model).is_dir()
