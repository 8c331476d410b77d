"""The launcher: plans from arguments and YAML (via --dry-run), the no-GPU refusal, and the
supervisor's start/ready/stop cycle against fake servers (no vLLM, no GPU needed)."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvelastic.cluster.liveness import is_alive
from kvelastic.launcher.plan import DEFAULT_MODEL_DIR
from kvelastic.launcher.supervisor import gpu_problem
from kvelastic.launcher.command import kvelastic_problem

REPO = Path(__file__).resolve().parents[1]


def launch(*args, env=None, timeout=60, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "kvelastic.launcher.command", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=cwd)


def dry_run(*args, whole=False):
    result = launch("--dry-run", "--json", *args)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    return plan if whole else plan["instances"]


def kvelastic_command() -> str:
    """The installed console script of this Python's kvelastic."""
    return str(Path(sys.executable).parent / "kvelastic")


# ------------------------------------------------------------------- dry run
def test_default_is_two_dummy_llama_1b_servers():
    first, second = dry_run()
    assert (first["port"], second["port"]) == (8001, 8002)
    assert first["name"] != second["name"]
    for inst in (first, second):
        cmd = inst["command"]
        assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(DEFAULT_MODEL_DIR)]
        assert cmd[cmd.index("--port") + 1] == str(inst["port"])
        assert cmd[cmd.index("--load-format") + 1] == "dummy"
        assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.25"
        assert inst["env"]["KVELASTIC"] == "1" and inst["env"]["KVELASTIC_NAME"] == inst["name"]
        assert inst["env"]["KVELASTIC_PORT"] == str(inst["port"])
        assert inst["url"] == f"http://127.0.0.1:{inst['port']}"


def test_dry_run_text_shows_environment_and_command():
    result = launch("--dry-run")
    assert result.returncode == 0, result.stderr
    assert "# llama-1b-8001: http://127.0.0.1:8001" in result.stdout
    assert "KVELASTIC=1 KVELASTIC_NAME=llama-1b-8002" in result.stdout
    assert "vllm.entrypoints.cli.main serve" in result.stdout


def test_instances_from_arguments():
    a, b = dry_run("--budget", "30GiB", "--device", "1", "--gpu-util", "0.3",
                   "--model", "/models/a", "--port", "9001", "--limit", "8GiB", "--min", "2GiB",
                   "--env", "KVELASTIC_CACHE_TTL=5", "--", "--enforce-eager", "--max-model-len", "2048",
                   "--and", "--model", "org/b", "--port", "9002", "--name", "bee", "--",
                   "--gpu-memory-utilization=0.4")
    assert a["name"] == "a-9001" and b["name"] == "bee"
    assert a["env"] == {"KVELASTIC": "1", "KVELASTIC_NAME": "a-9001", "KVELASTIC_PORT": "9001",
                        "KVELASTIC_LIMIT": "8GiB", "KVELASTIC_MIN": "2GiB", "KVELASTIC_SHARED_BUDGET": "30GiB",
                        "CUDA_VISIBLE_DEVICES": "1", "KVELASTIC_CACHE_TTL": "5"}
    assert a["command"][4:] == ["/models/a", "--port", "9001", "--gpu-memory-utilization", "0.3",
                                "--enforce-eager", "--max-model-len", "2048"]
    assert b["command"][4:] == ["org/b", "--port", "9002", "--gpu-memory-utilization=0.4"]
    assert "KVELASTIC_LIMIT" not in b["env"] and b["env"]["KVELASTIC_SHARED_BUDGET"] == "30GiB"


def test_instances_from_yaml(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    config = tmp_path / "fleet.yaml"
    config.write_text(textwrap.dedent("""\
        budget: 20GiB
        gpu_memory_utilization: 0.2
        instances:
          - model: models/tiny
            port: 8101
            name: tiny
            limit: 4GiB
            min: 1GiB
            vllm_args: --load-format dummy --enforce-eager
            env: {KVELASTIC_CACHE_TTL: 3}
          - model: org/other
            port: 8102
            gpu_memory_utilization: 0.35
            vllm_args: [--max-model-len, 1024]
        """))
    tiny, other = dry_run("--config", str(config))
    assert tiny["model"] == str((tmp_path / "models" / "tiny").resolve())
    assert tiny["command"][5:] == ["--port", "8101", "--gpu-memory-utilization", "0.2", "--load-format",
                                   "dummy", "--enforce-eager"]
    assert tiny["env"]["KVELASTIC_LIMIT"] == "4GiB" and tiny["env"]["KVELASTIC_MIN"] == "1GiB"
    assert tiny["env"]["KVELASTIC_SHARED_BUDGET"] == "20GiB" and tiny["env"]["KVELASTIC_CACHE_TTL"] == "3"
    assert other["model"] == "org/other" and other["name"] == "other-8102"
    assert other["command"][5:] == ["--port", "8102", "--gpu-memory-utilization", "0.35",
                                    "--max-model-len", "1024"]
    listed = tmp_path / "list.yaml"
    listed.write_text("- {model: org/x, port: 7001}\n")
    (only,) = dry_run("--config", str(listed), "--budget", "1GiB")
    assert only["env"]["KVELASTIC_SHARED_BUDGET"] == "1GiB"


@pytest.mark.parametrize("yaml_text, message", [
    ("- {model: m, port: 1, limt: 4GiB}\n", "unknown key(s) limt"),
    ("- {model: m, port: 1}\n- {model: n, port: 1}\n", "both use port 1"),
    ("- {model: m, port: 1, name: a}\n- {model: n, port: 2, name: a}\n", "both use name 'a'"),
    ("- {model: m, port: 1, limit: 4 gigs}\n", "instances[0] limit"),
    ("- {model: m}\n", "needs a port"),
    ("instances: 3\n", "expected a list of instances"),
    ("- {model: m, port: 1, gpu_memory_utilization: 2}\n", "fraction of GPU memory"),
    (": : :\n", "not valid YAML"),
    ('parallel: "no"\ninstances: [{model: m, port: 1}]\n', "parallel='no' must be true or false"),
    ("parallel: 1\ninstances: [{model: m, port: 1}]\n", "parallel=1 must be true or false"),
    ("- {model: m, port: true}\n", "port=True must be a TCP port"),
    ("- {model: m, port: 8001.5}\n", "port=8001.5 must be a TCP port"),
    ("- {model: m, port: 1, gpu_memory_utilization: yes}\n", "fraction of GPU memory"),
    ("- {model: m, port: 1, name: 12}\n", "name=12 must be"),
    ("- {model: m, port: 1, env: {KVELASTIC_LIMIT: [1]}}\n", "must be a string, a number or true/false"),
    ("device: [0, 1]\ninstances: [{model: m, port: 1}]\n", "must be GPU ids"),
    ("- {model: m, port: 1, limit: 0}\n", "KVELASTIC_LIMIT='0' must be larger than zero"),
    ("- {model: m, port: 1, env: {KVELASTIC_CACHE_TTL: soon}}\n", "KVELASTIC_CACHE_TTL='soon'"),
    ('- {model: m, port: "8001"}\n', "port='8001' must be a TCP port number, unquoted"),
    ('- {model: m, port: 1, gpu_memory_utilization: "0.3"}\n', "gpu_memory_utilization='0.3' must be a fraction"),
    ("- {model: m, port: 1, limit: 8GiB, env: {KVELASTIC_LIMIT: 4GiB}}\n",
     "env sets KVELASTIC_LIMIT, which the launcher sets itself from limit (KVELASTIC_LIMIT=8GiB)"),
    ("- {model: m, port: 1, env: {KVELASTIC_NAME: other}}\n", "env sets KVELASTIC_NAME"),
    ("budget: 40GiB\ninstances: [{model: m, port: 1, env: {KVELASTIC_SHARED_BUDGET: 8GiB}}]\n",
     "env sets KVELASTIC_SHARED_BUDGET, which the launcher sets itself from budget"),
    ("- {model: m, port: 1, limit: 4G}\n", "the unit 'G' is ambiguous"),
])
def test_bad_yaml_exits_2_with_a_precise_message(tmp_path, yaml_text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    result = launch("--dry-run", "--config", str(config))
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("args, message", [
    (["--port", "8001"], "needs --model"),
    (["--model", "m"], "needs --port"),
    (["--model", "m", "--port", "99999"], "TCP port"),
    (["--model", "m", "--port", "1", "--limit", "8XB"], "instance 1 limit"),
    (["--model", "m", "--port", "1", "--and", "--model", "n", "--port", "1"], "both use port 1"),
    (["--model", "m", "--port", "1", "--env", "NOEQUALS"], "VAR=VALUE"),
    (["--budget", "big"], "--budget"),
    (["--gpu-util", "0"], "--gpu-util=0.0 must be a fraction"),
    (["--config", "x.yaml", "--model", "m", "--port", "1"], "not both"),
])
def test_bad_arguments_exit_2(args, message):
    result = launch("--dry-run", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_launcher_options_belong_to_the_first_group():
    result = launch("--dry-run", "--model", "m", "--port", "1", "--and", "--model", "n", "--port", "2",
                    "--budget", "1GiB")
    assert result.returncode == 2 and "unrecognized arguments: --budget" in result.stderr


# -------------------------------------------------------------------- no GPU
def test_no_gpu_exits_non_zero_before_starting_anything(tmp_path):
    result = launch(env={"PATH": str(tmp_path)})  # an empty PATH: no nvidia-smi
    assert result.returncode == 3
    assert "no usable NVIDIA GPU, nothing started" in result.stderr and "nvidia-smi" in result.stderr
    assert result.stdout == ""
    forced = launch("--model", "m", "--port", "1", env={"KVELASTIC_LAUNCH_NO_GPU": "1"})
    assert forced.returncode == 3 and "KVELASTIC_LAUNCH_NO_GPU=1" in forced.stderr


def _fake_tool(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def test_gpu_check_reports_a_failing_driver_and_a_torch_without_cuda(tmp_path):
    _fake_tool(tmp_path / "nvidia-smi", "import sys; print('NVIDIA-SMI has failed'); sys.exit(9)\n")
    assert "nvidia-smi -L failed (exit 9): NVIDIA-SMI has failed" in gpu_problem({"PATH": str(tmp_path)})
    _fake_tool(tmp_path / "nvidia-smi", "print('GPU 0: Fake (UUID: GPU-0)')\n")
    no_cuda = _fake_tool(tmp_path / "python-no-cuda", "import sys; sys.exit(1)\n")
    assert "torch.cuda.is_available() is False" in gpu_problem({"PATH": str(tmp_path)}, python=str(no_cuda))
    with_cuda = _fake_tool(tmp_path / "python-cuda", "import sys; sys.exit(0)\n")
    assert gpu_problem({"PATH": str(tmp_path)}, python=str(with_cuda)) is None


# ------------------------------------------------------- kvelastic installed
@pytest.fixture
def bare_python(tmp_path, monkeypatch):
    """A real Python of its own (a venv without site packages): no kvelastic, no hooks.

    The probe runs in the current directory, as the servers do; in the checkout
    kvelastic and its egg-info would be found on sys.path, so move out of it.
    """
    monkeypatch.chdir(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True,
                   timeout=120)
    return str(tmp_path / "venv" / "bin" / "python")


def test_a_python_without_kvelastic_is_refused_before_anything_starts(tmp_path, bare_python):
    result = launch("--python", bare_python, cwd=tmp_path,  # not the checkout: kvelastic is not importable
                    env={"KVELASTIC_LAUNCH_NO_GPU": "1"})  # the check comes first, before the GPU probe
    assert result.returncode == 4, result.stderr
    assert f"kvelastic cannot be imported by {bare_python} (ModuleNotFoundError" in result.stderr
    assert "nothing started" in result.stderr and "--python" in result.stderr and result.stdout == ""


def test_kvelastic_on_sys_path_but_not_installed_is_refused(tmp_path, bare_python):
    source = tmp_path / "src"
    source.mkdir()
    (source / "kvelastic").symlink_to(REPO / "kvelastic")  # importable, but no entry point and no .pth
    env = {**os.environ, "PYTHONPATH": str(source), "KVELASTIC": "1"}
    problem = kvelastic_problem(bare_python, env)
    assert "vLLM would not load it" in problem and "no 'vllm.general_plugins' entry point" in problem
    assert "kvelastic-autopatch.pth" in problem
    result = launch("--python", bare_python, cwd=tmp_path, env={"PYTHONPATH": str(source)})
    assert result.returncode == 4 and "would run plain vLLM" in result.stderr, result.stderr


def test_an_entry_point_is_enough_unless_vllm_plugins_leaves_it_out(tmp_path, bare_python):
    site = tmp_path / "site"
    dist = site / "kvelastic-0.1.0.dist-info"  # what an install without the .pth line leaves
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvelastic\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nkvelastic = kvelastic.plugin:register\n")
    (site / "kvelastic").symlink_to(REPO / "kvelastic")
    env = {**os.environ, "PYTHONPATH": str(site), "KVELASTIC": "1"}
    env.pop("VLLM_PLUGINS", None)
    assert kvelastic_problem(bare_python, env) is None
    assert kvelastic_problem(bare_python, {**env, "VLLM_PLUGINS": "kvelastic,other"}) is None
    problem = kvelastic_problem(bare_python, {**env, "VLLM_PLUGINS": "other"})
    assert "VLLM_PLUGINS='other' leaves out its 'kvelastic' plugin" in problem


def test_the_installed_kvelastic_passes_and_a_broken_python_is_named(tmp_path):
    env = {**os.environ, "KVELASTIC": "1"}
    assert kvelastic_problem(sys.executable, env) is None
    assert kvelastic_problem(sys.executable, {**env, "VLLM_PLUGINS": "other"}) is None  # the .pth hook
    broken = _fake_tool(tmp_path / "python-broken", "import sys; sys.exit('no such interpreter here')\n")
    assert f"{broken} -c <probe> failed (exit 1): no such interpreter here" in kvelastic_problem(str(broken), env)
    assert "could not run" in kvelastic_problem(str(tmp_path / "missing"), env)


# ---------------------------------------------------------------- supervisor
FAKE_SERVER = """\
import http.server, os, signal, subprocess, sys, threading, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode = os.environ.get("FAKE_MODE", "ok")
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(os.environ["FAKE_DIR"], f"{port}.pids"), "w") as out:
    out.write(f"{os.getpid()} {engine.pid} {os.environ['KVELASTIC_NAME']}")
print("loading weights", flush=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else lambda *a: sys.exit(0))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Health)
time.sleep(0.3)
print("Application startup complete.", flush=True)
if mode == "crash":
    threading.Timer(1.0, lambda: os._exit(5)).start()
server.serve_forever()
"""

RUN_SUPERVISOR = """\
import sys
from pathlib import Path
from kvelastic.launcher.plan import LaunchPlan, make_instance
from kvelastic.launcher.supervisor import Supervisor
from kvelastic.launcher.command import install_stop_signals, supervise
fake, logs, ports, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
instances = tuple(make_instance(model="fake-model", port=p, env={"FAKE_MODE": m}) for p, m in zip(ports, modes))
install_stop_signals()
plan = LaunchPlan(instances=instances, python=fake, parallel=True)
sys.exit(supervise(Supervisor(plan, Path(logs), poll_s=0.1, stop_timeout_s=1.0, startup_timeout_s=60)))
"""


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _sigint_ignored(command: list[str]) -> list[str]:
    """``command`` started with SIGINT ignored, as a shell starts a background job."""
    return ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]


def _supervise(tmp_path: Path, modes: list[str], sigint_ignored: bool = False
               ) -> tuple[subprocess.Popen, list[int]]:
    fake = _fake_tool(tmp_path / "fake-python", FAKE_SERVER)
    ports = _free_ports(len(modes))
    env = {**os.environ, "FAKE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-c", RUN_SUPERVISOR, str(fake), str(tmp_path / "logs"),
               ",".join(map(str, ports)), ",".join(modes)]
    process = subprocess.Popen(_sigint_ignored(command) if sigint_ignored else command,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    return process, ports


def _wait_for(predicate, timeout=30.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _pids(tmp_path: Path, ports: list[int]) -> list[int]:
    return [int(p) for port in ports for p in (tmp_path / f"{port}.pids").read_text().split()[:2]]


def _all_gone(pids: list[int]) -> bool:
    return not any(is_alive(pid, 0) for pid in pids)  # zombies count as gone


def test_supervisor_starts_shows_progress_and_stops_on_sigterm(tmp_path):
    process, ports = _supervise(tmp_path, ["ok", "stubborn"])
    _wait_for(lambda: all((tmp_path / f"{p}.pids").exists() for p in ports))
    pids = _pids(tmp_path, ports)
    _wait_for(lambda: all(_healthy(p) for p in ports))
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out
    for port in ports:
        assert f"will listen on http://127.0.0.1:{port}" in out
        assert f"ready on http://127.0.0.1:{port}" in out
    assert "all 2 instance(s) ready" in out and "stop requested" in out
    assert "still running, SIGKILL" in out  # the stubborn one ignored SIGTERM
    _wait_for(lambda: _all_gone(pids), timeout=10)
    assert "Application startup complete." in (tmp_path / "logs" / f"fake-model-{ports[0]}.log").read_text()


def _started(tmp_path: Path, process: subprocess.Popen, ports: list[int]) -> list[int]:
    """The pids of the fake servers and their engines, once all answer /health."""
    _wait_for(lambda: all((tmp_path / f"{p}.pids").exists() for p in ports))
    pids = _pids(tmp_path, ports)
    _wait_for(lambda: all(_healthy(p) for p in ports))
    return pids


def _cleanup(process: subprocess.Popen, pids: list[int]) -> None:
    """After a failed test: leave no fake server behind."""
    process.kill()
    process.wait()
    for pid in pids:
        if is_alive(pid, 0):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_stops_every_server_even_when_started_with_sigint_ignored(tmp_path):
    process, ports = _supervise(tmp_path, ["ok", "ok"], sigint_ignored=True)
    pids = _started(tmp_path, process, ports)
    try:
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
        assert process.returncode == 0, out
        assert "stop requested" in out and out.count(": stopped (exit") == 2
        _wait_for(lambda: _all_gone(pids), timeout=10)
    finally:
        _cleanup(process, pids)


def test_servers_are_stopped_even_when_the_launcher_cannot_print_any_more(tmp_path):
    process, ports = _supervise(tmp_path, ["ok", "stubborn"])
    pids = _started(tmp_path, process, ports)
    try:
        process.stdout.close()  # the terminal or pipe went away: every print now fails with EPIPE
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        _wait_for(lambda: _all_gone(pids), timeout=10)  # the stubborn one too (SIGKILL after 1 s)
    finally:
        _cleanup(process, pids)


SLOW_NVIDIA_SMI = """\
import os, sys, time
path = os.path.join(os.environ["FAKE_DIR"], "smi.pid")
with open(path + ".tmp", "w") as out:
    out.write(str(os.getpid()))
os.replace(path + ".tmp", path)  # whole or absent: the test reads it as soon as it exists
time.sleep(60)  # a GPU probe that takes long (the launcher gives nvidia-smi 30 s)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_during_the_slow_gpu_probe_works_from_the_start(tmp_path, signum):
    """Before any server starts: the launcher must answer at once, and take the probe down with it."""
    _fake_tool(tmp_path / "nvidia-smi", SLOW_NVIDIA_SMI)
    env = {**os.environ, "FAKE_DIR": str(tmp_path), "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    env.pop("KVELASTIC_LAUNCH_NO_GPU", None)
    # A launcher started under nohup keeps SIGHUP ignored, by design; this test is about a terminal's
    # SIGHUP, so the launcher starts with the default disposition even when the suite runs under nohup.
    process = subprocess.Popen(_sigint_ignored([sys.executable, "-m", "kvelastic.launcher.command"]), env=env, cwd=REPO,
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    smi_pid = None
    try:
        _wait_for(lambda: (tmp_path / "smi.pid").exists())
        smi_pid = int((tmp_path / "smi.pid").read_text())
        process.send_signal(signum)
        out, err = process.communicate(timeout=15)  # not the 30 s nvidia-smi timeout
        assert process.returncode == 0, err
        assert "stopped before anything started" in err and out == ""
        _wait_for(lambda: not is_alive(smi_pid, 0), timeout=10)  # the probe's child went with it
    finally:
        process.kill()
        process.wait()
        if smi_pid is not None and is_alive(smi_pid, 0):
            os.kill(smi_pid, signal.SIGKILL)


def test_supervisor_stops_everything_when_one_server_dies(tmp_path):
    process, ports = _supervise(tmp_path, ["ok", "crash"])
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 1, out
    assert f"fake-model-{ports[1]} exited with code 5" in out
    assert "Application startup complete." in out  # the crashed server's last log line
    _wait_for(lambda: _all_gone(_pids(tmp_path, ports)), timeout=10)


def _healthy(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


# ------------------------------------------------------------ shipped model
def test_shipped_tokenizer_matches_the_model_config_and_rebuilds_identically(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    assert max(tokenizer.get_vocab().values()) < config["vocab_size"]
    ids = tokenizer.encode("Two models share one GPU.")
    assert ids[0] == config["bos_token_id"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Two models share one GPU."
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_tokenizer.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=120)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (DEFAULT_MODEL_DIR / name).read_bytes(), name
        assert (DEFAULT_MODEL_DIR / name).stat().st_size < 1_000_000


FAKE_SLEEPER = """\
import os, sys, time
status = open("/proc/self/status").read()
blocked = next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
with open(os.path.join(os.environ["FAKE_DIR"], "sigblk"), "w") as out:
    out.write(blocked)
time.sleep(600)
"""

STOP_DURING_START = """\
import json, os, signal, sys, time
from pathlib import Path
from kvelastic.launcher import supervisor as sv
from kvelastic.launcher.plan import LaunchPlan, make_instance
from kvelastic.launcher.command import install_stop_signals
fake, logs = sys.argv[1], sys.argv[2]
install_stop_signals()
real_spawn = sv.spawn

def spawn_then_stop(*args, **kwargs):
    process = real_spawn(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # the stop lands after the start, before the server is recorded
    time.sleep(0.2)
    return process

sv.spawn = spawn_then_stop
plan = LaunchPlan(instances=(make_instance(model="fake-model", port=18999),), python=fake)
sup = sv.Supervisor(plan, Path(logs), stop_timeout_s=2.0)
interrupted = False
try:
    sup.start(plan.instances[0])
except KeyboardInterrupt:
    interrupted = True
recorded = [s.process.pid for s in sup.servers]
blk = Path(os.environ["FAKE_DIR"], "sigblk")
deadline = time.time() + 20
while not blk.exists() and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.1)
sup.stop_all()
print(json.dumps({"interrupted": interrupted, "recorded": recorded, "sigblk": blk.read_text(),
                  "exit": [s.process.returncode for s in sup.servers]}))
"""


def test_a_stop_between_start_and_record_still_stops_that_server(tmp_path):
    """The stop is held until the server is recorded, then stops it; the server itself holds no signal."""
    fake = _fake_tool(tmp_path / "fake-python", FAKE_SLEEPER)
    env = {**os.environ, "FAKE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", STOP_DURING_START, str(fake), str(tmp_path / "logs")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["interrupted"], "the stop was lost"
    assert len(result["recorded"]) == 1, "the started server was not recorded"
    assert int(result["sigblk"], 16) & (1 << (signal.SIGTERM - 1)) == 0, "the server inherited a held SIGTERM"
    assert result["exit"] == [-signal.SIGTERM]
    assert not is_alive(result["recorded"][0], 0)


# ------------------------------------------- what the servers would refuse
@pytest.mark.parametrize("args, message", [
    (["--limit", "0"], "m-1: KVELASTIC_LIMIT='0' must be larger than zero"),
    (["--limit", "1KiB"], "m-1: KVELASTIC_LIMIT='1KiB' is smaller than one chunk (8MiB"),
    (["--min", "4GiB", "--limit", "2GiB"], "m-1: KVELASTIC_MIN='4GiB' is larger than KVELASTIC_LIMIT='2GiB'"),
    (["--env", "KVELASTIC_CACHE_TTL=soon"], "m-1: KVELASTIC_CACHE_TTL='soon' is not a number of seconds"),
    (["--env", "KVELASTIC_CACHE_TTL=inf"], "m-1: KVELASTIC_CACHE_TTL='inf' must be a finite"),
    (["--env", "KVELASTIC_PORT=8002"], "m-1: env sets KVELASTIC_PORT, which the launcher sets itself from port"),
    (["--env", "KVELASTIC_CHUNK_SIZE=3MiB"], "m-1: KVELASTIC_CHUNK_SIZE='3MiB' must be a positive multiple"),
])
def test_dry_run_refuses_what_a_server_would_refuse(args, message):
    result = launch("--dry-run", "--model", "m", "--port", "1", *args)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith(f"kvelastic launch: {message}"), result.stderr


def test_a_bad_setting_in_the_callers_environment_is_refused_too():
    result = launch("--dry-run", env={"KVELASTIC_CPU_POLICY": "fifo"})
    assert result.returncode == 2
    assert "llama-1b-8001: KVELASTIC_CPU_POLICY='fifo' is not one of: arc, lru" in result.stderr


def test_misspelt_variables_are_warned_about_once_each_and_nothing_is_refused():
    result = launch("--dry-run", "--model", "m", "--port", "1", "--env", "KVELASTIC_CPU_BYTE=64GiB",
                    "--and", "--model", "n", "--port", "2", env={"KVELASTIC_LIMT": "8GiB"})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "kvelastic launch: warning: your environment: KVELASTIC_LIMT is not a kvelastic setting and is "
        "ignored; did you mean KVELASTIC_LIMIT?",
        "kvelastic launch: warning: m-1: KVELASTIC_CPU_BYTE is not a kvelastic setting and is ignored; "
        "did you mean KVELASTIC_CPU_BYTES?"]


def test_yaml_booleans_are_strict_and_env_switches_become_1_or_0(tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text("parallel: no\ninstances:\n  - {model: m, port: 1, env: {KVELASTIC_STRICT: no}}\n")
    plan = dry_run("--config", str(config), whole=True)
    assert plan["parallel"] is False and plan["instances"][0]["env"]["KVELASTIC_STRICT"] == "0"
    config.write_text("parallel: true\ninstances:\n  - {model: m, port: 1}\n")
    assert dry_run("--config", str(config), whole=True)["parallel"] is True


# -------------------------------------------- installed command, caller's paths
def test_kvelastic_launch_resolves_paths_from_the_callers_directory(tmp_path):
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "fleet.yaml").write_text("- {model: org/hub-model, port: 9002}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVELASTIC")}
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    by_args = run([kvelastic_command(), "launch", "--dry-run", "--json", "--model", "./mymodel", "--port", "9001",
                   "--python", os.path.relpath(sys.executable, tmp_path)])
    assert by_args.returncode == 0, by_args.stderr
    (only,) = json.loads(by_args.stdout)["instances"]
    assert only["model"] == str(tmp_path / "mymodel") and only["name"] == "mymodel-9001"
    assert only["command"][0] == os.path.abspath(sys.executable)  # absolute, the venv's link kept
    by_file = run([kvelastic_command(), "launch", "--dry-run", "--json", "--config", "conf/fleet.yaml"])
    assert by_file.returncode == 0, by_file.stderr
    assert json.loads(by_file.stdout)["instances"][0]["model"] == "org/hub-model"  # not a path here: a hub id
    wrapper = run([str(REPO / "scripts" / "launch.sh"), "--dry-run", "--json", "--model", "mymodel", "--port", "1"],
                  env={**env, "PYTHON": sys.executable})
    assert wrapper.returncode == 0, wrapper.stderr
    assert json.loads(wrapper.stdout)["instances"][0]["model"] == str(tmp_path / "mymodel")


def test_the_default_model_ships_inside_the_package(tmp_path):
    import kvelastic

    assert DEFAULT_MODEL_DIR == Path(kvelastic.__file__).resolve().parent / "models" / "llama-1b"
    assert sorted(p.name for p in DEFAULT_MODEL_DIR.iterdir()) == [
        "config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    result = subprocess.run([sys.executable, "-m", "kvelastic", "launch", "--dry-run", "--json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert {i["model"] for i in json.loads(result.stdout)["instances"]} == {str(DEFAULT_MODEL_DIR)}
