"""Readers of shared files trust none of them: /metrics and ``kvelastic status``.

The collector runs in the API server's event loop on every scrape: a hostile
or broken snapshot (deep nesting, a non-object, non-finite numbers, a FIFO, a
file of another user) must neither raise (a 500) nor block (a hung server).
``kvelastic status`` must not crash on such numbers, nor pass terminal escapes
from a name to the terminal. The files are planted where the code under test
itself writes them, so run against the old code these tests fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvelastic.cluster import SharedAccount
from kvelastic.metrics.metrics import KvelasticCollector, StatsPublisher
from tests.other_user import FORK, OTHER_UID, needs_root

prometheus_client = pytest.importorskip("prometheus_client")
GIB = 1024**3


def _scrape(directory, timeout: float = 5.0) -> str:
    """What ``/metrics`` would serve, from a thread: AssertionError if it raises or does not return in time."""
    registry = prometheus_client.CollectorRegistry()
    registry.register(KvelasticCollector(directory, parents=(os.getpid(),)))
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_try(prometheus_client.generate_latest, registry)),
                              daemon=True)
    worker.start()
    worker.join(timeout)
    assert result, "the scrape hung on a shared file"
    assert not isinstance(result[0], BaseException), f"the scrape failed: {result[0]!r}"
    return result[0].decode()


def _try(fn, *args):
    try:
        return fn(*args)
    except BaseException as error:  # noqa: BLE001 - handed to the asserting thread
        return error


HOSTILE = {
    "deep nesting": b'{"name": "x", "pid": %d, "ppid": 0, "time": 0, "values": ' + b"[" * 20000 + b"]" * 20000
                    + b"}",
    "values not an object": b'{"name": "x", "pid": %d, "ppid": 0, "time": 0, "values": [1, 2]}',
    "infinity": b'{"name": "x", "pid": %d, "ppid": 0, "time": 0, "values": {"mapped_bytes": Infinity}}',
    "a number with 5000 digits": b'{"name": "x", "pid": %d, "ppid": 0, "time": 0, "values": {"mapped_bytes": '
                                 + b"9" * 5000 + b"}}",
    "not utf-8": b'{"name": "\xff\xfe", "pid": %d, "ppid": 0, "time": 0, "values": {}}',
    "not an object": b"[%d]",
    "too large": b'{"name": "x", "pid": %d, "ppid": 0, "time": 0, "values": {}, "pad": "' + b"a" * (1 << 20)
                 + b'"}',
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_snapshot_never_fails_a_scrape(tmp_path, kind):
    good = StatsPublisher("good", tmp_path)
    good.publish({"mapped_bytes": 4096})
    bad = StatsPublisher("bad", tmp_path)
    bad.publish({"mapped_bytes": 1})
    bad.path.write_bytes(HOSTILE[kind].replace(b"%d", str(os.getpid()).encode()))
    text = _scrape(tmp_path)
    assert 'kvelastic_mapped_bytes{instance_name="good",model_name=""} 4096.0' in text
    assert 'instance_name="bad"' not in text and 'instance_name="x"' not in text


def test_a_fifo_where_a_snapshot_should_be_never_hangs_a_scrape(tmp_path):
    good = StatsPublisher("good", tmp_path)
    good.publish({"mapped_bytes": 4096})
    bad = StatsPublisher("bad", tmp_path)
    bad.publish({"mapped_bytes": 1})
    bad.path.unlink()
    os.mkfifo(bad.path)
    try:
        assert 'kvelastic_mapped_bytes{instance_name="good",model_name=""} 4096.0' in _scrape(tmp_path)
    finally:
        _release_fifo_readers(bad.path)


def _release_fifo_readers(path) -> None:
    """A reader stuck opening the FIFO (the old code) gets end-of-file, so the test process can exit."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


def test_status_survives_non_finite_numbers_in_a_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    with SharedAccount.open("GPU-nan", 40 * GIB) as account:
        account.join("small").acquire(GIB)
        publisher = StatsPublisher("small")
        publisher.publish({"spilled_bytes": 1})
        publisher.path.write_text('{"name": "small", "pid": %d, "ppid": 0, "time": 0, "values": '
                                  '{"spilled_bytes": Infinity, "limit_bytes": NaN, "reloaded_bytes": 1e999}}'
                                  % os.getpid())
        for args in (["status", "--json"], ["status"]):
            result = _cli(tmp_path, *args)
            assert result.returncode == 0, result.stderr
        (member,) = json.loads(_cli(tmp_path, "status", "--json").stdout)["accounts"][0]["members"]
        assert member["mapped_bytes"] == GIB and "spilled_bytes" not in member and "limit_bytes" not in member


def _forge_name(account: SharedAccount, slot: int, name: str) -> None:
    """Write ``name`` into a record's name field, as a forged or corrupt file would hold it (join refuses it)."""
    from kvelastic.cluster.records import record_offset

    fd = os.open(account.path, os.O_RDWR)
    try:
        os.pwrite(fd, name.encode().ljust(64, b"\0"), record_offset(slot))
    finally:
        os.close(fd)


def test_terminal_escapes_in_names_never_reach_the_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    with SharedAccount.open("GPU-\x1b[31mred", 40 * GIB) as account:
        account.join("evil", model="\x1b]0;pwned\x07/models/x\r\n", port=8001)
        _forge_name(account, 0, "ev\x1b[2Jil\u202e")
        result = _cli(tmp_path, "status")
        assert result.returncode == 0, result.stderr
        for control in ("\x1b", "\x07", "\u202e", "\r"):
            assert control not in result.stdout
        assert "ev?[2Jil?" in result.stdout and "?]0;pwned?/models/x??" in result.stdout
        assert "\\u001b" in _cli(tmp_path, "status", "--json").stdout  # JSON escapes it: scripts still see it


def test_limit_shows_names_from_the_account_as_status_does(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    with SharedAccount.open("GPU-\x1b[31mred", 40 * GIB) as account:
        account.join("engine")
        account.join("evil")
        _forge_name(account, 1, "ev\x1b[2Jil\u202e")
        unknown = _cli(tmp_path, "limit", "nobody", "1GiB")
        assert unknown.returncode == 3 and "ev?[2Jil?" in unknown.stderr
        changed = _cli(tmp_path, "limit", "engine", "1GiB")
        assert changed.returncode == 0 and "engine on GPU GPU-?[31mred: max 1.00 GiB" in changed.stdout
        for output in (unknown.stdout + unknown.stderr, changed.stdout + changed.stderr):
            assert not any(control in output for control in ("\x1b", "\u202e"))


def _cli(root, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(root)}
    return subprocess.run([sys.executable, "-m", "kvelastic.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


# ------------------------------------------------------- another user's file
def _publish_and_exit(directory: str, out) -> None:
    publisher = StatsPublisher("gone", __import__("pathlib").Path(directory))
    publisher.publish({"mapped_bytes": 1})
    out.put(str(publisher.path))


@needs_root
def test_a_dead_engines_snapshot_owned_by_another_user_is_neither_read_nor_removed(tmp_path):
    out = FORK.Queue()
    child = FORK.Process(target=_publish_and_exit, args=(str(tmp_path), out))  # a child of this process...
    child.start()
    path = out.get(timeout=30)
    child.join(30)  # ...that died without removing its snapshot
    os.chown(path, OTHER_UID, OTHER_UID)  # which now belongs to someone else
    text = _scrape(tmp_path)
    assert 'instance_name="gone"' not in text
    assert os.path.exists(path), "a reader deleted another user's file"
    StatsPublisher("next", tmp_path)  # the next engine sweeps what dead engines of this user left
    assert os.path.exists(path), "the sweep deleted another user's file"


def test_a_snapshot_whose_engine_name_ends_in_a_newline_is_not_served(tmp_path):
    """``$`` alone matches before a trailing newline: the name check matches the whole name, so a newline
    never reaches a label of the exposition text."""
    good = StatsPublisher("good", tmp_path)
    good.publish({"mapped_bytes": 4096})
    bad = StatsPublisher("bad", tmp_path)
    bad.publish({"mapped_bytes": 1})
    written = bad.path.read_bytes()
    assert b'"bad"' in written
    bad.path.write_bytes(written.replace(b'"bad"', b'"bad\\n"', 1))
    text = _scrape(tmp_path)
    assert 'kvelastic_mapped_bytes{instance_name="good",model_name=""} 4096.0' in text
    assert 'instance_name="bad' not in text
