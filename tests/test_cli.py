"""The ``kvelastic`` command against a temporary shared directory filled by this test process."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from kvelastic.cluster import SharedAccount
from kvelastic.units import SIZE_FORM

GIB = 1024**3


def kvelastic(shared_dir, *args, timeout=60):
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(shared_dir)}
    return subprocess.run([sys.executable, "-m", "kvelastic.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def shared(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def fleet(shared):
    """One GPU account with two live members (both this process) holding some memory."""
    account = SharedAccount.open("GPU-aaaa", 40 * GIB)
    small = account.join("small", model="scripts/models/llama-1b", port=8001, min_bytes=2 * GIB)
    big = account.join("big", model="/models/meta-llama/Llama-3.1-8B-Instruct-with-a-long-path",
                       port=8002, max_bytes=16 * GIB)
    small.acquire(3 * GIB)
    small.report(cached_bytes=GIB, host_bytes=5 * GIB)
    big.acquire(12 * GIB)
    yield account, small, big
    account.close()


# -------------------------------------------------------------------- status
def test_status_prints_a_table_of_live_instances(fleet, shared):
    result = kvelastic(shared, "status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("GPU GPU-aaaa: budget 40.00 GiB")
    assert "15.00 GiB" in lines[0] and "free 25.00 GiB" in lines[0]
    header = lines[1].split()
    assert header[:9] == ["INSTANCE", "PID", "MODEL", "PORT", "MAPPED", "CACHED", "HOST", "MIN", "MAX"]
    small = next(line for line in lines if line.split()[0] == "small")
    assert str(os.getpid()) in small and "8001" in small and "scripts/models/llama-1b" in small
    assert "3.00 GiB" in small and "1.00 GiB" in small and "5.00 GiB" in small and "2.00 GiB" in small
    assert small.split()[-5:-3] == ["GiB", "none"]  # min 2.00 GiB, no max
    big = next(line for line in lines if line.split()[0] == "big")
    assert "12.00 GiB" in big and "16.00 GiB" in big and "...-8B-Instruct-with-a-long-path " in big


def test_status_json_is_for_scripts(fleet, shared):
    result = kvelastic(shared, "status", "--json")
    assert result.returncode == 0, result.stderr
    (account,) = json.loads(result.stdout)["accounts"]
    assert account["gpu"] == "GPU-aaaa" and account["budget_bytes"] == 40 * GIB
    assert account["charged_bytes"] == 15 * GIB
    members = {m["name"]: m for m in account["members"]}
    assert members["small"]["mapped_bytes"] == 3 * GIB and members["small"]["min_bytes"] == 2 * GIB
    assert members["small"]["host_bytes"] == 5 * GIB and members["small"]["port"] == 8001
    assert members["big"]["max_bytes"] == 16 * GIB and members["big"]["pid"] == os.getpid()


def test_status_json_adds_the_host_tier_numbers_an_engine_publishes(fleet, shared):
    from kvelastic.metrics.metrics import StatsPublisher

    publisher = StatsPublisher("small")  # what the engine of "small" (this process) writes
    publisher.publish({"mapped_bytes": 2 * GIB, "limit_bytes": 8 * GIB, "spilled_bytes": 7 * GIB,
                       "reloaded_bytes": 3 * GIB, "host_bytes_used": 5 * GIB, "host_hits": 4})
    (account,) = json.loads(kvelastic(shared, "status", "--json").stdout)["accounts"]
    small, big = (next(m for m in account["members"] if m["name"] == n) for n in ("small", "big"))
    assert (small["spilled_bytes"], small["reloaded_bytes"]) == (7 * GIB, 3 * GIB)
    assert (small["host_bytes_used"], small["limit_bytes"]) == (5 * GIB, 8 * GIB)
    assert "host_hits" not in small
    assert "spilled_bytes" not in big  # no snapshot with that name: absent, not 0
    renamed = StatsPublisher("someone-else")  # same pid, another name: not small's numbers
    renamed.publish({"spilled_bytes": 9})
    members = json.loads(kvelastic(shared, "status", "--json").stdout)["accounts"][0]["members"]
    assert [m.get("spilled_bytes") for m in members if "spilled_bytes" in m] == [7 * GIB]
    publisher.remove()
    members = json.loads(kvelastic(shared, "status", "--json").stdout)["accounts"][0]["members"]
    assert all("spilled_bytes" not in m for m in members)
    assert kvelastic(shared, "status").returncode == 0  # the table still renders
    renamed.remove()


def test_status_lists_every_gpu_or_the_one_asked_for(fleet, shared):
    with SharedAccount.open("GPU-bbbb", 80 * GIB) as other:
        other.join("solo", port=9000)
        both = kvelastic(shared, "status")
        assert "GPU GPU-aaaa" in both.stdout and "GPU GPU-bbbb" in both.stdout and "solo" in both.stdout
        one = kvelastic(shared, "status", "--gpu", "GPU-bbbb", "--json")
        assert [a["gpu"] for a in json.loads(one.stdout)["accounts"]] == ["GPU-bbbb"]


def test_dead_instances_are_not_listed(fleet, shared):
    code = ("from kvelastic.cluster import SharedAccount\n"
            "SharedAccount.open('GPU-aaaa', 1).join('ghost').acquire(1024)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # exits without leaving
    result = kvelastic(shared, "status")
    assert "ghost" not in result.stdout and "small" in result.stdout


def test_status_without_accounts_or_instances_exits_4(shared):
    result = kvelastic(shared, "status")
    assert result.returncode == 4
    assert "no account" in result.stderr and str(shared) in result.stderr
    assert kvelastic(shared, "status", "--gpu", "GPU-none").returncode == 4
    with SharedAccount.open("GPU-empty", GIB):
        result = kvelastic(shared, "status")
        assert result.returncode == 4 and "no live kvelastic instances" in result.stderr
        assert "(no live instances)" in result.stdout


def ctrl_c_as_in_the_foreground() -> None:
    """Ctrl-C reaches a command in the foreground; a suite run in the background inherits SIGINT ignored
    (and Python then installs no handler), so a command the test interrupts starts with SIGINT at its default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_watch_refreshes_until_interrupted(fleet, shared):
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(shared)}
    watcher = subprocess.Popen([sys.executable, "-m", "kvelastic.cli", "status", "--watch", "0.1"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=ctrl_c_as_in_the_foreground)
    seen, deadline = [], time.time() + 30
    while sum("GPU GPU-aaaa" in line for line in seen) < 2 and time.time() < deadline:
        seen.append(watcher.stdout.readline())  # the watcher flushes after every refresh
    watcher.send_signal(signal.SIGINT)
    out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err
    assert sum("GPU GPU-aaaa" in line for line in seen) >= 2 and "Ctrl-C" in "".join(seen)


def test_watch_needs_a_positive_interval(fleet, shared):
    result = kvelastic(shared, "status", "--watch", "0")
    assert result.returncode == 2 and "--watch" in result.stderr


# --------------------------------------------------------------------- limit
def test_limit_changes_what_the_instance_reads(fleet, shared):
    _, small, big = fleet
    result = kvelastic(shared, "limit", "small", "8GiB", "--min", "1GiB")
    assert result.returncode == 0, result.stderr
    assert "small" in result.stdout and "8.00 GiB" in result.stdout
    assert small.limits() == (GIB, 8 * GIB)
    assert kvelastic(shared, "limit", "small", "none", "--min", "none").returncode == 0
    assert small.limits() == (0, 0)  # it started without a cap: 'none' puts that back
    assert kvelastic(shared, "limit", "big", "--max", "1.5GB").returncode == 0
    assert big.limits() == (0, 1_500_000_000)


@pytest.mark.parametrize("spelling", [["none"], ["--max", "none"], ["--reset"], ["reset"]])
def test_none_restores_the_cap_the_instance_started_with(fleet, shared, spelling):
    _, _, big = fleet  # joined with max 16 GiB, as an engine joins with its profiled KV size
    assert kvelastic(shared, "limit", "big", "4GiB").returncode == 0
    assert big.limits() == (0, 4 * GIB)
    result = kvelastic(shared, "limit", "big", *spelling)
    assert result.returncode == 0, result.stderr
    assert big.limits() == (0, 16 * GIB)  # never 0: the engine must not grow over the whole GPU
    assert "max 16.00 GiB (its start-up cap)" in result.stdout
    shown = json.loads(kvelastic(shared, "status", "--json").stdout)["accounts"][0]["members"]
    assert {m["name"]: (m["max_bytes"], m["start_max_bytes"]) for m in shown}["big"] == (16 * GIB, 16 * GIB)


def test_a_cap_cannot_be_removed_and_a_restore_below_the_min_is_refused(fleet, shared):
    big = fleet[2]
    for word in ("unlimited", "off", "0"):
        result = kvelastic(shared, "limit", "big", "--max", word)
        assert result.returncode == 2 and "cannot run without a cap" in result.stderr
    assert big.limits() == (0, 16 * GIB)
    assert kvelastic(shared, "limit", "big", "20GiB", "--min", "18GiB").returncode == 0
    result = kvelastic(shared, "limit", "big", "--reset")
    assert result.returncode == 2 and "below its min" in result.stderr
    assert big.limits() == (18 * GIB, 20 * GIB)  # nothing changed
    assert kvelastic(shared, "limit", "big", "--reset", "--min", "1GiB").returncode == 0  # one step
    assert big.limits() == (GIB, 16 * GIB)


def test_limit_of_an_unknown_instance_exits_3(fleet, shared):
    result = kvelastic(shared, "limit", "nobody", "8GiB")
    assert result.returncode == 3
    assert "'nobody'" in result.stderr and "big, small" in result.stderr


@pytest.mark.parametrize("args, argument", [
    (["small", "8XB"], "MAX"),
    (["small", "--max", "lots"], "--max"),
    (["small", "4GiB", "--min", "-1"], "--min"),
])
def test_a_bad_size_exits_2_naming_the_argument_and_the_form(fleet, shared, args, argument):
    result = kvelastic(shared, "limit", *args)
    assert result.returncode == 2
    assert f"{argument}=" in result.stderr and SIZE_FORM in result.stderr and "'none'" in result.stderr


@pytest.mark.parametrize("args, text", [
    (["small"], "give a new MAX"),
    (["small", "4GiB", "--max", "5GiB"], "one way only"),
    (["small", "--reset", "--max", "5GiB"], "one way only"),
    (["small", "1GiB", "--min", "2GiB"], "below its min"),
    (["small", "--min", "41GiB"], "does not fit"),
])
def test_impossible_limits_exit_2(fleet, shared, args, text):
    result = kvelastic(shared, "limit", *args)
    assert result.returncode == 2 and text in result.stderr
    assert fleet[1].limits() == (2 * GIB, 0)


def test_limit_without_accounts_exits_4(shared):
    result = kvelastic(shared, "limit", "small", "8GiB")
    assert result.returncode == 4 and "no account" in result.stderr


def test_usage_errors_exit_2(shared):
    assert kvelastic(shared).returncode == 2
    assert kvelastic(shared, "frobnicate").returncode == 2
    assert kvelastic(shared, "status", "--watch", "soon").returncode == 2


# -------------------------------------------------------------------- budget
def test_budget_is_shown_and_changed(fleet, shared):
    account = fleet[0]
    shown = kvelastic(shared, "budget")
    assert shown.returncode == 0 and "GPU GPU-aaaa: budget 40.00 GiB" in shown.stdout
    assert kvelastic(shared, "budget", "60GiB").returncode == 0
    assert account.budget == 60 * GIB
    bad = kvelastic(shared, "budget", "0")
    assert bad.returncode == 2 and "larger than zero" in bad.stderr
    below = kvelastic(shared, "budget", "1GiB")  # "small" reserves 2 GiB
    assert below.returncode == 2 and "below what the members reserve" in below.stderr
    assert kvelastic(shared, "budget", "lots").returncode == 2
    with SharedAccount.open("GPU-bbbb", GIB):
        several = kvelastic(shared, "budget", "1GiB")
        assert several.returncode == 2 and "--gpu" in several.stderr
        assert kvelastic(shared, "budget", "2GiB", "--gpu", "GPU-bbbb").returncode == 0
    assert account.budget == 60 * GIB


# -------------------------------------------------------------------- polish
def test_version_matches_the_installed_distribution(shared):
    from importlib.metadata import version

    result = kvelastic(shared, "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"kvelastic {version('kvelastic')}"


def test_status_json_without_any_account_is_still_json(shared):
    result = kvelastic(shared, "status", "--json")
    assert result.returncode == 4 and json.loads(result.stdout) == {"accounts": []}
    assert "no account" in result.stderr


FAKE_SMI = """\
import sys
assert sys.argv[1:] == ["--query-gpu=index,uuid", "--format=csv,noheader"], sys.argv
print("0, GPU-0000aaaa-1111\\n1, GPU-1234abcd-5678")
"""


def _with_fake_smi(tmp_path, shared):
    tools = tmp_path / "bin"
    tools.mkdir()
    smi = tools / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n{FAKE_SMI}")
    smi.chmod(0o755)
    return {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}


def test_gpu_is_an_account_id_an_nvidia_smi_uuid_or_an_index(tmp_path, shared):
    path_env = _with_fake_smi(tmp_path, shared)
    env = {**os.environ, **path_env, "KVELASTIC_SHARED_DIR": str(shared)}
    run = lambda *args: subprocess.run([sys.executable, "-m", "kvelastic.cli", *args], env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=60)
    with SharedAccount.open("gpu-1234abcd-5678", 8 * GIB) as account, SharedAccount.open("gpu-0000aaaa-1111", GIB):
        member = account.join("solo", port=9000)
        for spelling in ("gpu-1234abcd-5678", "GPU-1234abcd-5678", "1"):
            result = run("status", "--gpu", spelling, "--json")
            assert result.returncode == 0, (spelling, result.stderr)
            assert [a["gpu"] for a in json.loads(result.stdout)["accounts"]] == ["gpu-1234abcd-5678"]
        assert run("limit", "solo", "3GiB", "--gpu", "1").returncode == 0
        assert member.limits() == (0, 3 * GIB)
        missing = run("status", "--gpu", "7")
        assert missing.returncode == 2
        assert "--gpu 7: nvidia-smi lists no GPU with index 7 (indexes: 0, 1)" in missing.stderr
        no_smi = subprocess.run([sys.executable, "-m", "kvelastic.cli", "status", "--gpu", "0"],
                                env={**env, "PATH": str(tmp_path / "empty")}, capture_output=True, text=True,
                                timeout=60)
        assert no_smi.returncode == 2 and "nvidia-smi is not on PATH" in no_smi.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly(fleet, shared):
    """``kvelastic status | head -0``: every write meets a closed pipe; no traceback, exit 141 like SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "kvelastic.cli", "status"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=60,
                                env={**os.environ, "KVELASTIC_SHARED_DIR": str(shared)})
    finally:
        os.close(write_end)
    assert result.returncode == 141
    assert result.stderr == ""


@pytest.mark.parametrize("args", [["limit", "small", "1KiB"], ["limit", "small", "--max", "1MiB"],
                                  ["budget", "1MiB"]])
def test_a_size_below_one_chunk_is_refused(fleet, shared, args):
    result = kvelastic(shared, *args)
    assert result.returncode == 2 and "is smaller than one chunk (at least 2.00 MiB" in result.stderr
    assert fleet[1].limits() == (2 * GIB, 0) and fleet[0].budget == 40 * GIB


def test_launch_is_a_subcommand(shared):
    result = kvelastic(shared, "launch", "--dry-run", "--json", "--model", "org/m", "--port", "9001")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["instances"][0]["name"] == "m-9001"
    assert "kvelastic launch" in kvelastic(shared, "launch", "--help").stdout
    assert "launch" in kvelastic(shared, "--help").stdout


# ----------------------------------------------------------------------- top
def test_sparkline_draws_each_reading_as_its_share_of_the_scale():
    from kvelastic.top import sparkline

    assert sparkline([0, 1, 4 * GIB, 8 * GIB, 9 * GIB], 8 * GIB) == " ▁▄██"
    assert sparkline([], GIB) == "" and sparkline([GIB], 0) == " "


def test_top_shows_each_instance_with_the_history_of_what_it_mapped(fleet, shared):
    from rich.console import Console

    from kvelastic.cli import read_accounts, snapshot
    from kvelastic.top import History, render

    history = History(length=3)
    account, small, big = fleet
    for step in range(4):
        small.acquire(4 * GIB)
        history.add(read_accounts(None))
    console = Console(record=True, width=200, color_system=None)
    console.print(render(snapshot([account]), history))
    text = console.export_text()
    assert "GPU GPU-aaaa: budget 40.00 GiB" in text
    small_line = next(line for line in text.splitlines() if "small" in line)
    # 11, 15 and 19 GiB of a 40 GiB budget: 2.2, 3.0 and 3.8 eighths, rounded up
    assert "19.00 GiB" in small_line and small_line.rstrip(" │").endswith("▃▃▄")
    assert list(history.of("GPU-aaaa", "big")) == [12 * GIB] * 3
    big.leave()
    history.add(snapshot([account]))
    assert list(history.of("GPU-aaaa", "big")) == []  # an instance that left is forgotten


def test_top_refreshes_count_times_and_refuses_a_bad_interval(fleet, shared):
    result = kvelastic(shared, "top", "--interval", "0.05", "--count", "2")
    assert result.returncode == 0, result.stderr
    assert "small" in result.stdout and "big" in result.stdout and "GPU GPU-aaaa" in result.stdout
    bad = kvelastic(shared, "top", "--interval", "0")
    assert bad.returncode == 2 and "--interval: '0' is not a number of seconds above 0" in bad.stderr


def test_top_without_a_terminal_prints_each_refresh_as_it_comes_each_line_ending(fleet, shared):
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(shared)}
    top = subprocess.Popen([sys.executable, "-m", "kvelastic.cli", "top", "--interval", "0.2"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=ctrl_c_as_in_the_foreground)
    try:
        ready, _, _ = select.select([top.stdout], [], [], 30)  # while it runs: the first refresh comes out
        assert ready, "top printed nothing while it ran"
        first = top.stdout.readline()
        assert top.poll() is None and first.startswith("GPU GPU-aaaa: budget 40.00 GiB"), first
    finally:
        top.send_signal(signal.SIGINT)
        out, err = top.communicate(timeout=60)
    assert top.returncode == 0, err
    counted = kvelastic(shared, "top", "--interval", "0.05", "--count", "3")
    assert counted.stdout.endswith("\n") and counted.stdout.count("GPU GPU-aaaa: budget") == 3


def test_top_with_a_count_exits_as_status_does(shared):
    none = kvelastic(shared, "top", "--count", "1")
    assert none.returncode == 4 == kvelastic(shared, "status").returncode
    assert "no account" in none.stdout
    with SharedAccount.open("GPU-empty", GIB):
        assert kvelastic(shared, "top", "--count", "1").returncode == 4  # an account, no live instance
        assert kvelastic(shared, "status").returncode == 4
