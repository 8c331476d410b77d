"""``kvelastic launch`` before anything starts: logs never through a link, the vLLM release
checked, timeouts that mean something, a help text without markup or test-only variables."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvelastic.patching.versions import FIRST_UNSUPPORTED, OLDEST_SUPPORTED
from tests.fake_vllm_version import python_seeing_vllm
from tests.other_user import OTHER_UID, as_user, needs_root, shared_root  # noqa: F401
from tests.test_launch import FAKE_SERVER, REPO, RUN_SUPERVISOR, _fake_tool, _free_ports, launch

INSTALL = f'pip install "vllm>={OLDEST_SUPPORTED},<{FIRST_UNSUPPORTED}"'


def _plant(path: str, how: str, target: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.chmod(os.path.dirname(path), 0o777)  # a folder made ahead under a predictable name, open to all
    if how == "symlink":
        os.symlink(target, path)
    else:
        with open(path, "w") as planted:
            planted.write("")
        os.chmod(path, 0o666)
    return "planted"


@needs_root
@pytest.mark.parametrize("how", ["symlink", "world-writable file"])
def test_a_log_planted_in_a_shared_log_dir_is_refused_before_any_server_starts(shared_root, tmp_path, how):
    """Another user made the log folder ahead (a predictable name under /tmp) and planted the first log in it.

    Not sticky, so the kernel's protected_symlinks and protected_regular (which guard sticky folders such
    as /tmp itself) do not stop the write: only the launcher can."""
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    logs = shared_root / "logs"
    (port,) = _free_ports(1)
    assert as_user(_plant, str(logs / f"fake-model-{port}.log"), how, str(precious)) == "planted"
    fake = _fake_tool(tmp_path / "fake-python", FAKE_SERVER)
    try:
        done = subprocess.run([sys.executable, "-c", RUN_SUPERVISOR, str(fake), str(logs), str(port), "ok"],
                              env={**os.environ, "FAKE_DIR": str(tmp_path)}, capture_output=True, text=True,
                              timeout=60, cwd=REPO)
    except subprocess.TimeoutExpired:
        done = None  # it started the server and watched it: what the launcher did before the fix
    finally:
        _stop_fake_servers(tmp_path / f"{port}.pids")
    assert done is not None and done.returncode == 1, done and done.stdout + done.stderr
    assert ("symbolic link" if how == "symlink" else "not a regular file of this user") in done.stdout
    assert precious.read_text() == "keep me", "the launcher wrote through another user's link"
    assert not (tmp_path / f"{port}.pids").exists(), "a server started although its log could not be opened"


def _stop_fake_servers(pids: Path) -> None:
    """Stop the fake server (and its engine) a launch started, should it have started one."""
    if not pids.exists():
        return
    for pid in pids.read_text().split()[:2]:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_launcher_refuses_an_unsupported_vllm_before_anything_starts(tmp_path):
    python = python_seeing_vllm(tmp_path, "0.99.0")
    done = launch("--python", str(python), "--model", "m", "--port", str(_free_ports(1)[0]),
                  env={"KVELASTIC_LAUNCH_NO_GPU": "1"})
    assert done.returncode == 5, done.stdout + done.stderr
    assert "has vLLM 0.99.0, which kvelastic does not support" in done.stderr and INSTALL in done.stderr
    assert "nothing started" in done.stderr


def test_no_vllm_or_an_unreadable_version_is_named_with_the_fix():
    from kvelastic.launcher.command import vllm_problem

    assert INSTALL in vllm_problem("/x/python", None) and "not installed in /x/python" in vllm_problem("/x/python", None)
    assert "does not support" in vllm_problem("/x/python", "banana")
    assert vllm_problem("/x/python", "0.25.0") is None


@pytest.mark.parametrize("args, message", [
    (["--startup-timeout", "nan"], "--startup-timeout: 'nan' is not a number of seconds above 0"),
    (["--startup-timeout", "0"], "--startup-timeout: '0' is not a number of seconds above 0"),
    (["--startup-timeout", "inf"], "--startup-timeout: 'inf'"),
    (["--stop-timeout", "-1"], "--stop-timeout: '-1' is not a number of seconds 0 or more"),
    (["--stop-timeout", "nan"], "--stop-timeout: 'nan'"),
    (["--name", "modèle", "--model", "m", "--port", "1"], "ASCII letters"),
])
def test_the_launcher_refuses_meaningless_timeouts_and_names(args, message):
    result = launch("--dry-run", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_launch_help_is_plain_text_for_users():
    shown = launch("--help")
    assert shown.returncode == 0
    text = shown.stdout
    assert "Start several kvelastic-enabled vLLM servers on one GPU." in text and "--and" in text
    for markup in ("``", ":mod:", ":func:", "KVELASTIC_LAUNCH_NO_GPU"):
        assert markup not in text, markup
    via_cli = subprocess.run([sys.executable, "-m", "kvelastic.cli", "launch", "--help"], capture_output=True,
                             text=True, timeout=60)
    assert via_cli.stdout == text
    assert Path(REPO).is_dir()
