"""What the GPU and the servers do while the load runs, sampled in background threads.

- GPU memory: the device's used bytes and each compute process's, through NVML
  (``pynvml``, the ``nvidia-ml-py`` package) or else ``nvidia-smi``. A process is
  put to a server by walking up its parents to the ``vllm ... serve ... --port N``
  process it descends from (vLLM's engine core is a child of its API server).
- ``/metrics`` of every server: a few of vLLM's series (preemptions, queue,
  prefix cache) and every ``kvelastic_*`` series (the engines' own reclaim
  timing among them), summed over label sets (one engine per server), parsed
  with prometheus_client's own parser.
- The kvelastic account of the GPU (kvelastic configurations only), read as
  ``kvelastic status --json`` reads it: per member mapped, cached, host-tier
  and refused ("wanted") bytes. Budget refusals and their end, seen here, are
  the summary's cross-check of the reclaim latency the engines time themselves.

Samplers are threads, not tasks, so a slow read never delays a token's
timestamp on the client's event loop.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any, Callable, Collection, Protocol

from prometheus_client.parser import text_string_to_metric_families

WATCHED = ("vllm:num_preemptions_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
           "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
KVELASTIC_PREFIX = "kvelastic_"
MIB = 1 << 20


class Sampler(threading.Thread):
    """Calls ``read`` every ``period_s`` seconds until stopped; keeps ``{"t": clock(), **reading}``.

    A reading of None is skipped; an exception is counted (the first one kept), never fatal.
    :meth:`begin` returns once the first reading was taken (a baseline before the load),
    :meth:`stop` takes a last one (the state at the end, not up to a period earlier).
    """

    def __init__(self, name: str, read: Callable[[], dict[str, Any] | None], period_s: float,
                 clock: Callable[[], float], close: Callable[[], None] = lambda: None):
        super().__init__(name=f"sampler-{name}", daemon=True)
        self.read, self.period_s, self.clock, self.close = read, period_s, clock, close
        self.samples: list[dict[str, Any]] = []
        self.errors = 0
        self.first_error: str | None = None
        self._halt, self._first = threading.Event(), threading.Event()

    def sample(self) -> None:
        began = self.clock()
        try:
            reading = self.read()
        except Exception as error:  # noqa: BLE001 - a missed sample, never a dead sampler
            self.errors += 1
            self.first_error = self.first_error or f"{type(error).__name__}: {error}"[:300]
            reading = None
        if reading is not None:
            self.samples.append({"t": round(began, 4), **reading})

    def run(self) -> None:
        while not self._halt.is_set():
            began = self.clock()
            self.sample()
            self._first.set()
            self._halt.wait(max(0.0, self.period_s - (self.clock() - began)))

    def begin(self, timeout_s: float = 30.0) -> None:
        """Start the thread and wait for its first reading."""
        self.start()
        self._first.wait(timeout_s)

    def stop(self) -> dict[str, Any]:
        """Stop, wait for the thread, take a last reading, and return what it gathered."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=30)
        self.sample()
        self.close()
        return {"period_s": self.period_s, "samples": self.samples, "errors": self.errors,
                "first_error": self.first_error}


# ------------------------------------------------------------------ /metrics
def metric_values(text: str) -> dict[str, float]:
    """The watched vLLM series and every ``kvelastic_*`` one, each summed over its label sets.

    A histogram bucket keeps its bound: ``NAME_bucket{le="0.5"}`` (summed over the other labels).
    """
    wanted = [line for line in text.splitlines()
              if line.startswith(KVELASTIC_PREFIX) or line.split("{", 1)[0].split(" ", 1)[0] in WATCHED]
    values: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(wanted) + "\n"):
        for sample in family.samples:
            key = f'{sample.name}{{le="{sample.labels["le"]}"}}' if "le" in sample.labels else sample.name
            values[key] = values.get(key, 0.0) + float(sample.value)
    return values


def metrics_reader(urls: dict[str, str], timeout_s: float = 5.0) -> Callable[[], dict[str, Any]]:
    """A reader of every server's ``/metrics``: model -> values (None where the scrape failed)."""
    def read() -> dict[str, Any]:
        found: dict[str, Any] = {}
        for model, url in urls.items():
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as reply:
                    found[model] = metric_values(reply.read().decode(errors="replace"))
            except (OSError, ValueError):
                found[model] = None
        return {"servers": found}
    return read


# ------------------------------------------------------------------ GPU memory
def port_in_args(args: list[str], ports: Collection[int]) -> int | None:
    """The port of ``... serve ... --port N`` among ``ports``, or None."""
    if "serve" not in args:
        return None
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--port" and i + 1 < len(args) else arg.partition("=")[2]
        if (arg == "--port" or arg.startswith("--port=")) and value.isdigit() and int(value) in ports:
            return int(value)
    return None


def owner_port(pid: int, ports: Collection[int], proc: Path = Path("/proc"), depth: int = 8) -> int | None:
    """The port of the server ``pid`` belongs to: itself or the nearest ancestor serving one of ``ports``."""
    for _ in range(depth):
        try:
            args = (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = (proc / str(pid) / "stat").read_text()
        except OSError:
            return None  # gone, or a pid of another namespace (a container seeing host pids)
        if (port := port_in_args(args, ports)) is not None:
            return port
        pid = int(stat.rpartition(")")[2].split()[1])  # the field after the command name: ppid
        if pid <= 1:
            return None
    return None


class MemorySource(Protocol):
    """One reading of the GPU: (used bytes, {pid: used bytes})."""

    def read(self) -> tuple[int, dict[int, int]]: ...


class NvmlSource:
    def __init__(self, index: int):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> tuple[int, dict[int, int]]:
        used = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return used, {int(p.pid): int(p.usedGpuMemory or 0) for p in procs}


class SmiSource:
    def __init__(self, index: int):
        self.index = str(index)

    def _query(self, what: str) -> list[list[str]]:
        text = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits", "-i", self.index],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        return [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip()]

    def read(self) -> tuple[int, dict[int, int]]:
        used = int(self._query("gpu=memory.used")[0][0]) * MIB
        procs = {int(row[0]): int(row[1]) * MIB for row in self._query("compute-apps=pid,used_memory")
                 if len(row) == 2 and row[0].isdigit() and row[1].isdigit()}
        return used, procs


def open_memory_source(kind: str, index: int) -> tuple[MemorySource | None, str]:
    """The source asked for ('auto': NVML, else nvidia-smi), and a line saying which one is used or why none."""
    if kind in ("auto", "nvml"):
        try:
            return NvmlSource(index), "NVML (pynvml)"
        except Exception as error:  # noqa: BLE001 - ImportError or any NVMLError: try the next
            if kind == "nvml":
                return None, f"no NVML: {type(error).__name__}: {error}"
    if kind in ("auto", "nvidia-smi") and shutil.which("nvidia-smi"):
        return SmiSource(index), "nvidia-smi"
    return None, "no GPU memory source" if kind != "none" else "GPU memory not sampled (--memory none)"


class GpuMemory:
    """Readings of a memory source with each process put to a server port (once per pid)."""

    def __init__(self, source: MemorySource, ports: Collection[int]):
        self.source, self.ports = source, tuple(ports)
        self.owners: dict[int, int | None] = {}

    def read(self) -> dict[str, Any]:
        used, procs = self.source.read()
        for pid in procs:
            if pid not in self.owners:
                self.owners[pid] = owner_port(pid, self.ports)
        return {"used": used, "procs": {str(pid): nbytes for pid, nbytes in procs.items()}}


# ------------------------------------------------------------------ kvelastic account
class AccountReader:
    """Reads the kvelastic accounts of this user, as ``kvelastic status --json`` does (None until one exists)."""

    FIELDS = ("mapped_bytes", "cached_bytes", "host_bytes", "wanted_bytes", "max_bytes", "min_bytes")

    def __init__(self) -> None:
        from kvelastic import cli

        self.cli = cli
        self.accounts: list[Any] = []

    def __call__(self) -> dict[str, Any] | None:
        if not self.accounts:
            try:
                self.accounts = self.cli.open_accounts(None, [])
            except self.cli.CliError:
                return None
        found = []
        for acct in self.cli.snapshot(self.accounts):
            members = {m["name"]: {k: m.get(k, 0) for k in self.FIELDS} for m in acct["members"]}
            found.append({"gpu": acct["gpu"], "budget": acct["budget_bytes"], "members": members})
        return {"accounts": found}

    def close(self) -> None:
        for account in self.accounts:
            account.close()
        self.accounts = []
