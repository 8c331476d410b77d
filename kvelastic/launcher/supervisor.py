"""Start the servers of a launch plan, show their start-up, and stop them cleanly.

Each server runs in its own session (process group), with its output in a log
file, so a Ctrl-C at the terminal reaches only the launcher, which then stops
every server the same way: SIGTERM to the whole group (vLLM's API server and
its engine-core children), a grace period, then SIGKILL for what is left.
Readiness is vLLM's own ``GET /health`` answering 200.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Mapping, Sequence, TextIO

from kvelastic.cluster.errors import LaunchFailed
from kvelastic.cluster.liveness import group_alive
from kvelastic.launcher.plan import Instance, LaunchPlan

NO_GPU_ENV = "KVELASTIC_LAUNCH_NO_GPU"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CUDA_PROBE = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@contextmanager
def stop_signals_held() -> Iterator[set[signal.Signals] | None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP until the block ends; yields the mask to restore (None: not held).

    A stop that lands between a server's start and its recording would leave
    that server running unseen in its own session; held, it is delivered (and
    raises) right after the server is recorded. Only the main thread holds them.
    """
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield previous
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def spawn(command: Sequence[str], env: Mapping[str, str], log: IO[bytes],
          signal_mask: set[signal.Signals] | None) -> subprocess.Popen:
    """Start ``command`` in its own session, output to ``log``, with ``signal_mask`` as its signal mask.

    A child inherits the signals its parent holds; it gets the mask from before
    :func:`stop_signals_held`, or vLLM would never see the SIGTERM that stops it.
    """
    reset = None if signal_mask is None else functools.partial(signal.pthread_sigmask, signal.SIG_SETMASK,
                                                               signal_mask)
    return subprocess.Popen(list(command), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=reset)


def gpu_problem(environ: Mapping[str, str] | None = None, python: str = sys.executable) -> str | None:
    """Why no vLLM server could use a GPU here, or None when one can.

    Checks that ``nvidia-smi -L`` lists a GPU and that torch in ``python`` sees
    CUDA. ``KVELASTIC_LAUNCH_NO_GPU=1`` forces the answer "no GPU" (tests).
    """
    env = os.environ if environ is None else environ
    if env.get(NO_GPU_ENV) == "1":
        return f"{NO_GPU_ENV}=1 is set"
    smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if smi is None:
        return "nvidia-smi is not on PATH (no NVIDIA driver on this machine?)"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi could not run: {error}"
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        detail = (listed.stderr or listed.stdout).strip().splitlines()[-1:] or ["no GPU listed"]
        return f"nvidia-smi -L failed (exit {listed.returncode}): {detail[0]}"
    try:
        probe = subprocess.run([python, "-c", _CUDA_PROBE], capture_output=True, timeout=180, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"could not ask torch about CUDA: {error}"
    if probe.returncode != 0:
        return f"torch.cuda.is_available() is False in {python}"
    return None


_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_log(directory: Path, name: str) -> IO[bytes]:
    """``directory/<name>.log``, created or emptied for writing; never through a symlink, never another's file.

    A log folder may be one others can write (``/tmp/logs``): a link planted
    there under a server's log name would otherwise make the launcher truncate
    and overwrite whatever it points to, and a file planted there would receive
    the server's output for its owner to read. LaunchFailed names the file.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.log"
    try:
        fd = os.open(path, _LOG_FLAGS, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise LaunchFailed(f"the log file {path} is a symbolic link; kvelastic launch never writes through "
                               f"one (remove it, or choose another --log-dir)") from None
        raise LaunchFailed(f"cannot open the log file {path}: {error.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise LaunchFailed(f"the log file {path} is not a regular file of this user (uid {st.st_uid}); kvelastic "
                           f"launch does not write into it (remove it, or choose another --log-dir)")
    os.ftruncate(fd, 0)
    return os.fdopen(fd, "wb")


def last_log_line(path: Path, width: int = 110) -> str:
    """The last non-empty line of a log, without colour codes, cut to ``width``."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 4096))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [_ANSI.sub("", line).strip() for line in tail.replace("\r", "\n").splitlines()]
    lines = [line for line in lines if line]
    text = lines[-1] if lines else ""
    return text if len(text) <= width else text[:width - 3] + "..."


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def healthy(instance: Instance, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(instance.url + "/health", timeout=timeout_s) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Server:
    """A started instance: its process, log, and when it came up."""

    instance: Instance
    process: subprocess.Popen
    log_path: Path
    started: float
    ready_at: float | None = None
    shown_line: str = field(default="", repr=False)
    shown_at: float = field(default=0.0, repr=False)


class Supervisor:
    """Runs one launch plan from start to stop; :meth:`run` returns the exit code."""

    def __init__(self, plan: LaunchPlan, log_dir: Path, *, out: TextIO = sys.stdout,
                 startup_timeout_s: float = 900.0, stop_timeout_s: float = 30.0, poll_s: float = 1.0,
                 base_env: Mapping[str, str] | None = None):
        self.plan = plan
        self.log_dir = Path(log_dir)
        self.out = out
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.servers: list[Server] = []
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.out, flush=True)

    # ------------------------------------------------------------- lifecycle
    def run(self) -> int:
        """Start (one after another, or all at once), wait until ready, watch, stop."""
        try:
            logs = {i.name: open_log(self.log_dir, i.name) for i in self.plan.instances}  # all, before any starts
            waves = [self.plan.instances] if self.plan.parallel else [(i,) for i in self.plan.instances]
            for wave in waves:
                started = [self.start(instance, logs.pop(instance.name)) for instance in wave]
                self.wait_ready(started)
            self.say(f"all {len(self.servers)} instance(s) ready; Ctrl-C stops them")
            for server in self.servers:
                self.say(f"  {server.instance.name}: {server.instance.url}  (log {server.log_path})")
            self.watch()
        except KeyboardInterrupt:
            self.say("stop requested")
            return 0
        except LaunchFailed as error:
            self.say(f"error: {error}")
            return 1
        finally:
            self.stop_all()
        return 0

    def start(self, instance: Instance, log: IO[bytes] | None = None) -> Server:
        """Start ``instance`` with its output to ``log`` (its log file in the log folder, opened if not given)."""
        log_path = self.log_dir / f"{instance.name}.log"
        log = log if log is not None else open_log(self.log_dir, instance.name)
        env = {**self.base_env, **self.plan.env(instance)}
        with log, stop_signals_held() as previous_mask:
            process = spawn(self.plan.command(instance), env, log, previous_mask)
            server = Server(instance, process, log_path, time.monotonic())
            self.servers.append(server)
        self.say(f"{instance.name}: starting pid {process.pid}, will listen on {instance.url} "
                 f"(log {log_path})")
        return server

    def wait_ready(self, servers: list[Server]) -> None:
        """Poll ``/health`` until every server answers; LaunchFailed if one exits or times out."""
        pending = list(servers)
        while pending:
            for server in list(pending):
                self._check_alive(server)
                if healthy(server.instance):
                    server.ready_at = time.monotonic()
                    self.say(f"{server.instance.name}: ready on {server.instance.url} "
                             f"after {server.ready_at - server.started:.1f}s")
                    pending.remove(server)
                    continue
                if time.monotonic() - server.started > self.startup_timeout_s:
                    raise LaunchFailed(f"{server.instance.name} was not ready after "
                                       f"{self.startup_timeout_s:.0f}s (log {server.log_path})")
                self._show_progress(server)
            if pending:
                time.sleep(self.poll_s)

    def _show_progress(self, server: Server) -> None:
        """Print the server's last log line when it changed (at most every 2s) or every 10s."""
        now = time.monotonic()
        line = last_log_line(server.log_path)
        if (line != server.shown_line and now - server.shown_at >= 2) or now - server.shown_at >= 10:
            self.say(f"{server.instance.name}: starting ({now - server.started:.0f}s) | {line or '...'}")
            server.shown_line, server.shown_at = line, now

    def _check_alive(self, server: Server) -> None:
        code = server.process.poll()
        if code is not None:
            raise LaunchFailed(f"{server.instance.name} exited with code {code}: "
                               f"{last_log_line(server.log_path) or 'no output'} (log {server.log_path})")

    def watch(self) -> None:
        """Sleep until a server exits on its own (LaunchFailed) or Ctrl-C."""
        while True:
            for server in self.servers:
                self._check_alive(server)
            time.sleep(self.poll_s)

    # ------------------------------------------------------------------ stop
    def stop_all(self) -> None:
        """SIGTERM every server's group, wait up to the grace period, then SIGKILL what is left."""
        running = [s for s in self.servers if _group_alive(s.process)]
        if not running:
            return
        self.say(f"stopping {len(running)} instance(s) (SIGTERM, SIGKILL after {self.stop_timeout_s:.0f}s)")
        for server in running:
            _signal_group(server.process, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        try:
            while any(_group_alive(s.process) for s in running) and time.monotonic() < deadline:
                time.sleep(0.1)
        except KeyboardInterrupt:
            self.say("second interrupt: killing now")
        for server in running:
            if _group_alive(server.process):
                self.say(f"{server.instance.name}: still running, SIGKILL")
                _signal_group(server.process, signal.SIGKILL)
            server.process.wait()
            self.say(f"{server.instance.name}: stopped (exit {server.process.returncode})")


def _group_alive(process: subprocess.Popen) -> bool:
    """Whether the server or any process of its group (vLLM's engine core) still runs.

    Reaps the leader first. Zombies do not count: in a container without an
    init process, orphans that exited may never be reaped.
    """
    process.poll()
    return group_alive(process.pid)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
