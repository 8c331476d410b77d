"""Where the host's CPU goes while the load runs: each server's API server, its engine, the client.

On an H100 a busy model's engine sometimes had no request running
or waiting while the client had a dozen without a first token: they were held
before vLLM's scheduler, in its API server, which also streams every token of
every running request. Whether that server (one Python process per model) or
the host's 16 cores run out is what these samples tell.

A server is the ``vllm ... serve ... --port N`` process (vLLM's API server);
everything below it (the engine core and its workers) is its engine, except
the API server processes of ``--api-server-count`` > 1, which vLLM titles
``VLLM::APIServer_<i>`` (through ``setproctitle``; without it they count as
engine). With two of them, the parent only supervises. Readings
are cumulative CPU seconds from ``/proc/PID/stat`` (user + system, the process's
own threads), so a rate needs two samples (:func:`cpu_rates`); the host's line
of ``/proc/stat`` gives how busy all cores were.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Collection

from benchmarks.mmbench.sampling import port_in_args

TICKS = os.sysconf("SC_CLK_TCK")
#: What vLLM's ``set_process_title`` makes of an API server's command line (``VLLM::APIServer_0``).
API_SERVER_TITLE = b"::APIServer"


def _stat_fields(proc: Path, pid: str) -> list[str] | None:
    try:
        text = (proc / pid / "stat").read_text()
    except OSError:
        return None  # gone between the listing and the read
    return text.rpartition(")")[2].split()  # fields after the command name: state, ppid, ...


def process_table(proc: Path = Path("/proc")) -> dict[int, tuple[int, float]]:
    """Every process: pid -> (parent pid, CPU seconds so far)."""
    table = {}
    for entry in proc.iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(proc, entry.name)) is not None:
            table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS)
    return table


def host_ticks(proc: Path = Path("/proc")) -> tuple[int, int]:
    """All cores' (busy, total) clock ticks since boot (iowait and idle count as not busy)."""
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    fields = [int(v) for v in (proc / "stat").read_text().splitlines()[0].split()[1:9]]
    total = sum(fields)
    return total - fields[3] - fields[4], total


class CpuReader:
    """One reading: per server, its API server's and its engine's CPU seconds; the client's; the host's ticks."""

    def __init__(self, ports: dict[int, str], proc: Path = Path("/proc"), me: int | None = None):
        self.ports, self.proc, self.me = ports, proc, os.getpid() if me is None else me
        self.roots: dict[int, str] = {}  # API server pid -> model
        self._serves: dict[int, bool] = {}  # a process below a root: is it one of vLLM's API servers?

    def _find_roots(self, table: dict[int, tuple[int, float]]) -> None:
        """The API servers: processes serving a port whose parent does not (a forked child keeps the
        command line of its parent, and belongs to its engine)."""
        serving = {}
        for pid in table:
            try:
                args = (self.proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if (port := port_in_args(args, self.ports)) is not None:
                serving[pid] = self.ports[port]
        self.roots = {pid: model for pid, model in serving.items() if table[pid][0] not in serving}

    def __call__(self) -> dict[str, Any]:
        table = process_table(self.proc)
        if len(self.roots) < len(self.ports):
            self._find_roots(table)
        servers: dict[str, dict[str, float]] = {}
        children = children_of(table)
        for root, model in self.roots.items():
            if root not in table:
                continue
            api, engine, titled = table[root][1], 0.0, 0
            for pid in descendants(children, root):
                if self._is_api_server(pid):
                    api += table[pid][1]
                    titled += 1
                else:
                    engine += table[pid][1]
            # api_n: the API server processes (the root alone when none is titled)
            servers[model] = {"api_s": round(api, 3), "engine_s": round(engine, 3), "api_n": max(1, titled)}
        busy, total = host_ticks(self.proc)
        client = table.get(self.me, (0, 0.0))[1]
        return {"servers": servers, "client_s": round(client, 3), "host_busy": busy, "host_total": total}


    def _is_api_server(self, pid: int) -> bool:
        """Whether ``pid`` is titled as one of vLLM's API server processes (read once per process)."""
        if pid not in self._serves:
            try:
                title = (self.proc / str(pid) / "cmdline").read_bytes()
            except OSError:
                return False  # gone: its CPU left the table with it
            self._serves[pid] = API_SERVER_TITLE in title
        return self._serves[pid]


def children_of(table: dict[int, tuple[int, float]]) -> dict[int, list[int]]:
    """Each process's children, from a :func:`process_table`."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    return children


def descendants(children: dict[int, list[int]], root: int) -> list[int]:
    """Every process below ``root``, given :func:`children_of` the process table."""
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def cpu_rates(samples: list[dict[str, Any]], begin: float, end: float,
              models: Collection[str]) -> dict[str, Any] | None:
    """Mean cores used in ``[begin, end]`` by each model's API server and engine, the client, and the host.

    From the first and last samples inside the window; None with fewer than two.
    """
    inside = [s for s in samples if begin <= s["t"] <= end]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    seconds = last["t"] - first["t"]
    if seconds <= 0:
        return None

    def rate(get: Callable[[dict[str, Any]], float | None]) -> float | None:
        a, b = get(first), get(last)
        return None if a is None or b is None else round((b - a) / seconds, 2)

    servers = {m: {part: rate(lambda s, m=m, part=part: s["servers"].get(m, {}).get(part))
                   for part in ("api_s", "engine_s")} for m in models}
    total = last["host_total"] - first["host_total"]
    host = round((last["host_busy"] - first["host_busy"]) / total, 3) if total > 0 else None
    return {"servers": servers, "client": rate(lambda s: s["client_s"]), "host_busy": host}


def front_end_bound(samples: list[dict[str, Any]], requests: list[dict[str, Any]], ttft_slo_s: float,
                    share: float = 0.85) -> dict[str, Any] | None:
    """Of the requests over the TTFT objective, how many waited while their model's API servers were saturated.

    A request counts when, in some sampling interval overlapping its wait for
    the first token, its model's API server processes used at least ``share`` of
    one core each: the front end, not the engine or its KV memory, was then the
    likely holder (50 of 57 slow requests of one kvelastic run with two API servers). None
    for runs whose samples predate the process count (``api_n``).
    """
    if not samples or "api_n" not in next(iter(samples[-1]["servers"].values()), {}):
        return None
    intervals = []
    for first, last in zip(samples, samples[1:]):
        seconds = last["t"] - first["t"]
        if seconds <= 0:
            continue
        saturated = {model: (now["api_s"] - before["api_s"]) / seconds >= share * now["api_n"]
                     for model, now in last["servers"].items()
                     if (before := first["servers"].get(model)) is not None}
        intervals.append((first["t"], last["t"], saturated))
    slow = [r for r in requests if r.get("ttft_s") is not None and r["ttft_s"] > ttft_slo_s
            and r.get("sent_s") is not None]
    held = sum(any(saturated.get(r["model"]) and begin < r["sent_s"] + r["ttft_s"] and end > r["sent_s"]
                   for begin, end, saturated in intervals) for r in slow)
    return {"slow": len(slow), "front_end_saturated": held, "share": share}
