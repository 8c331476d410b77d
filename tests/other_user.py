"""A second local user for the security tests: code run as another uid, and a folder both can use.

CI runs as root, so a forked child can become any uid (``os.setuid``) and a
subprocess can be started as one; without root these tests skip, saying why.
The shared root is made like ``/dev/shm``: world-writable with the sticky bit.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

import kvelastic.cli  # noqa: F401 - loaded before a child becomes a user who may not read the interpreter's files

OTHER_UID = OTHER_GID = 54321  # no account on the machine needs to exist for it
THIRD_UID = 54322
FORK = multiprocessing.get_context("fork")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root (CI runs as root)")


class RunsCodeWhenUnpickled:
    """What an attacker plants where kvelastic once used pickle: loading it writes ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def _become(uid: int, gid: int, groups: list[int]) -> None:
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)


def _child(result, uid: int, gid: int, groups: list[int], fn: Callable[..., Any], args: tuple) -> None:
    try:
        _become(uid, gid, groups)
        result.put(("ok", fn(*args)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which asserts on it
        result.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def as_user(fn: Callable[..., Any], *args: Any, uid: int = OTHER_UID, gid: int = OTHER_GID,
            groups: tuple[int, ...] = (), timeout: float = 60) -> Any:
    """Run ``fn(*args)`` in a forked child that became ``uid``; its return value, or its error as text."""
    result = FORK.Queue()
    child = FORK.Process(target=_child, args=(result, uid, gid, list(groups), fn, args))
    child.start()
    try:
        status, value = result.get(timeout=timeout)
    finally:
        child.join(timeout)
    return value if status == "ok" else ("error", value)


def _cli(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    from kvelastic.cli import main

    os.environ.clear()
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def cli_as(uid: int, argv: list[str], env: dict[str, str], groups: tuple[int, ...] = ()) -> tuple[int, str, str]:
    """``kvelastic ARGV`` in a process of user ``uid``: (exit code, stdout, stderr).

    A forked child rather than a new interpreter: the interpreter may live
    where the other user cannot read it (a home directory of mode 0700).
    """
    result = as_user(_cli, argv, env, uid=uid, gid=uid, groups=groups)
    assert not (isinstance(result, tuple) and result[0] == "error"), result
    return result


def _serve(ready, done, fn: Callable[..., Any], args: tuple) -> None:
    try:
        held = fn(*args)  # noqa: F841 - kept alive until done
        ready.put("ready")
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        ready.put(f"{type(error).__name__}: {error}")
        return
    done.wait(120)


class RunningAs:
    """``fn(*args)`` run in a process of another user, which stays until the block ends."""

    def __init__(self, uid: int, fn: Callable[..., Any], *args: Any, groups: tuple[int, ...] = ()):
        self.ready, self.done = FORK.Queue(), FORK.Event()
        self.process = FORK.Process(target=_child_serving, args=(uid, list(groups), self.ready, self.done, fn, args))

    def __enter__(self) -> "RunningAs":
        self.process.start()
        state = self.ready.get(timeout=60)
        assert state == "ready", state
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def _child_serving(uid: int, groups: list[int], ready, done, fn: Callable[..., Any], args: tuple) -> None:
    _become(uid, uid, groups)
    _serve(ready, done, fn, args)


@pytest.fixture
def shared_root(monkeypatch):
    """A ``/dev/shm``-like folder (mode 1777) as ``KVELASTIC_SHARED_DIR``, removed afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="kvelastic-test-", dir=base))
    root.chmod(0o1777)
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(root))
    monkeypatch.delenv("KVELASTIC_SHARED_GROUP", raising=False)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def env_with(root: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(root), **extra}
    env.pop("KVELASTIC_SHARED_GROUP", None)
    env.update(extra)
    return env
