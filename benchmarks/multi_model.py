"""Many models on one GPU: an open-loop, bursty, staggered client for N servers.

Each model alternates busy periods (a request rate one third of the GPU cannot
serve; prompts share long per-model prefixes) and idle periods, offset so that
at most one or two are busy at once. The schedule is fixed by a seed and
printed first. Every request is a streamed greedy completion whose token ids
and arrival times are kept, so one run gives per model and overall TTFT and
TPOT p50/p99, SLO attainment (TTFT < 1 s and TPOT < 100 ms by default),
goodput, failed and unfinished requests; in the background it samples each
server's GPU memory, its ``/metrics`` (preemptions, prefix cache, kvelastic's
host tier, the engines' own reclaim timing) and, for kvelastic, the GPU's shared
account (budget refusals: a cross-check of the reclaim latency). With
``--server-logs`` the engines' reclaim log lines (exact durations) are read too.

    python3 benchmarks/multi_model.py schedule                      # print the schedule, send nothing
    python3 benchmarks/multi_model.py run --config static --out static.json [--account]
    python3 benchmarks/multi_model.py summarize static.json kvelastic.json
    python3 benchmarks/multi_model.py summarize kvelastic.json --server-logs servers/   # exact reclaim times
    python3 benchmarks/multi_model.py compare static.json kvelastic.json   # tokens against the reference

``benchmarks/multi_model.sh CONFIG`` starts the servers on the GPU machine and runs this;
``benchmarks/plot_multi_model.py`` draws the memory plot from the JSON (benchmarks/README.md).
Exit codes: run 0 done, 1 a server not ready or the run interrupted; compare 0 every probe
identical, 1 one differs or is missing; 2 bad arguments or runs of different workloads.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.*

import aiohttp  # noqa: E402

from benchmarks.mmbench import compare as comparing  # noqa: E402
from benchmarks.mmbench.client import NotReady, OpenLoop, Server, new_record, wait_ready  # noqa: E402
from benchmarks.mmbench.cpu import CpuReader  # noqa: E402
from benchmarks.mmbench.reclaim import read_logs  # noqa: E402
from benchmarks.mmbench.sampling import (AccountReader, GpuMemory, Sampler, metrics_reader,  # noqa: E402
                                         open_memory_source)
from benchmarks.mmbench.summary import render, summarize  # noqa: E402
from benchmarks.mmbench.workload import Request, Workload, WorkloadError, describe, digest, schedule  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
WARMUP_S, PROBES_S = 10.0, 30.0  # what --deadline keeps for the warm-up and the probes after the load
DEFAULTS = Workload()


def _workload_options(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--models", nargs="+", default=list(DEFAULTS.models), help="served model names, one per server")
    add("--seed", type=int, default=DEFAULTS.seed)
    add("--duration", type=float, default=DEFAULTS.duration_s, help="seconds of load (default %(default)s)")
    add("--period", type=float, default=DEFAULTS.period_s, help="busy+idle cycle of every model, seconds")
    add("--busy", type=float, default=DEFAULTS.busy_s, help="busy seconds per cycle")
    add("--busy-rate", type=float, default=DEFAULTS.busy_rate, help="requests/s of a busy model (Poisson)")
    add("--idle-rate", type=float, default=DEFAULTS.idle_rate, help="requests/s of an idle model")
    add("--families", type=int, default=DEFAULTS.families, help="shared prefixes per model")
    add("--prefix-tokens", type=int, default=DEFAULTS.prefix_tokens)
    add("--suffix-min", type=int, default=DEFAULTS.suffix_min)
    add("--suffix-max", type=int, default=DEFAULTS.suffix_max)
    add("--output-tokens", type=int, default=DEFAULTS.output_tokens)
    add("--probes", type=int, default=DEFAULTS.probes, help="probe requests per model after the load")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring.")
    sub = p.add_subparsers(dest="command", required=True)
    _workload_options(sub.add_parser("schedule", help="print the schedule and offered load"))
    run = sub.add_parser("run", help="drive the servers and write the JSON")
    _workload_options(run)
    add = run.add_argument
    add("--config", required=True, help="label of the configuration (static, kvelastic, ...)")
    add("--out", required=True, help="result JSON")
    add("--host", default="127.0.0.1")
    add("--ports", type=int, nargs="+", default=[8101, 8102, 8103], help="one per model, in --models order")
    add("--slo-ttft", type=float, default=1.0, help="seconds (default %(default)s)")
    add("--slo-tpot", type=float, default=0.1, help="seconds (default %(default)s)")
    add("--timeout", type=float, default=120.0, help="seconds one request may take")
    add("--drain", type=float, default=60.0, help="seconds to wait for requests still running after the last send")
    add("--ready-timeout", type=float, default=600.0, help="seconds for every server to answer /health")
    add("--deadline", type=float, help="seconds from start by which the run must end: a load that cannot fit "
                                       "after start-up is not begun, and the drain is shortened to fit")
    add("--watch-pid", type=int, action="append", default=[], help="stop waiting if this process exits")
    add("--memory", choices=("auto", "nvml", "nvidia-smi", "none"), default="auto", help="GPU memory source")
    add("--gpu-index", type=int, default=0, help="NVML / nvidia-smi index of the GPU")
    add("--account", action="store_true", help="sample the kvelastic account (kvelastic configurations)")
    add("--server-logs", metavar="DIR", help="the servers' log folder: its reclaim episode lines (exact "
                                             "durations) go into the result")
    summ = sub.add_parser("summarize", help="print the summary of result files")
    summ.add_argument("results", nargs="+")
    summ.add_argument("--server-logs", metavar="DIR", help="read the reclaim episode lines from here (one result)")
    comp = sub.add_parser("compare", help="count responses whose tokens differ from the reference run")
    comp.add_argument("reference")
    comp.add_argument("others", nargs="+")
    comp.add_argument("--json", help="write the comparisons here")
    return p


def workload_from(args: argparse.Namespace) -> Workload:
    return Workload(models=tuple(args.models), seed=args.seed, duration_s=args.duration, period_s=args.period,
                    busy_s=args.busy, busy_rate=args.busy_rate, idle_rate=args.idle_rate, families=args.families,
                    prefix_tokens=args.prefix_tokens, suffix_min=args.suffix_min, suffix_max=args.suffix_max,
                    output_tokens=args.output_tokens, probes=args.probes)


# ------------------------------------------------------------------ run
def process_problem(pids: list[int]) -> Callable[[], str | None]:
    """A check that names the first watched process that has exited (or is a zombie)."""
    def problem() -> str | None:
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            except OSError:
                state = "gone"
            if state in ("gone", "Z", "X"):
                return f"process {pid} exited"
        return None
    return problem


def start_samplers(args: argparse.Namespace, servers: list[Server],
                   clock: Callable[[], float]) -> tuple[dict[str, Sampler], dict[str, Any]]:
    """Memory, /metrics, CPU and (with --account) account samplers, started; plus what they measure."""
    source, what = open_memory_source(args.memory, args.gpu_index)
    memory = GpuMemory(source, args.ports) if source else None
    samplers = {"metrics": Sampler("metrics", metrics_reader({s.model: s.url for s in servers}), 1.0, clock),
                "cpu": Sampler("cpu", CpuReader(dict(zip(args.ports, (s.model for s in servers)))), 1.0, clock)}
    if memory:
        samplers["memory"] = Sampler("memory", memory.read, 0.5, clock)
    if args.account:
        reader = AccountReader()
        samplers["account"] = Sampler("account", reader, 0.2, clock, close=reader.close)
    for sampler in samplers.values():
        sampler.begin()
    return samplers, {"memory_source": what, "memory": memory}


def stop_samplers(samplers: dict[str, Sampler], extra: dict[str, Any]) -> dict[str, Any]:
    gathered = {name: sampler.stop() for name, sampler in samplers.items()}
    gathered.setdefault("memory", {"samples": []})["source"] = extra["memory_source"]
    if extra["memory"] is not None:
        gathered["memory"]["owners"] = {str(pid): port for pid, port in extra["memory"].owners.items()}
    return gathered


async def warm_up(session: aiohttp.ClientSession, servers: list[Server], workload: Workload,
                  clock: Callable[[], float], timeout_s: float) -> list[dict[str, Any]]:
    """One short request per server, outside the schedule and its prefixes (first-request costs)."""
    short = dataclasses.replace(workload, prefix_tokens=0)
    loop = OpenLoop(session, {s.model: s for s in servers}, short, timeout_s, clock)
    warm = [Request(-1 - m, s.model, 0.0, 0, 32, 4) for m, s in enumerate(servers)]
    return list(await asyncio.gather(*(loop.send(r) for r in warm)))


CLIENT_KEEPALIVE_S = 2.0  # below the server's keep-alive (uvicorn: 5 s)


async def drive(args: argparse.Namespace, workload: Workload, requests: list[Request],
                servers: list[Server], result: dict[str, Any]) -> None:
    """Wait for the servers, then warm-up, the timed load, the probes; samplers run throughout."""
    origin = time.perf_counter()
    clock = lambda: time.perf_counter() - origin  # noqa: E731 - one clock for every timestamp
    result["clock_epoch"] = time.time() - clock()  # the wall time of t = 0: engines log wall times
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    # vLLM's server (uvicorn) closes a connection idle for 5 s; aiohttp keeps one for 15 s, so a
    # request could go out on a socket the server was closing and fail with a reset before vLLM
    # saw it (2 of 1,861 in one H100 run). Let idle connections go first.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        exited = process_problem(args.watch_pid)
        problem = lambda: "stopped by a signal" if stop.is_set() else exited()  # noqa: E731
        result["ready_s"] = round(await wait_ready(session, servers, args.ready_timeout, problem), 1)
        print(f"all {len(servers)} servers ready after {result['ready_s']} s", flush=True)
        drain = fit_drain(args, workload, clock())
        samplers, extra = start_samplers(args, servers, clock)
        load = OpenLoop(session, {s.model: s for s in servers}, workload, args.timeout, clock)
        try:
            result["warmup"] = await warm_up(session, servers, workload, clock, args.timeout)
            print("warm-up: " + ", ".join(f"{r['model']} {r['status']}" + (f" ({r['error']})" if r["error"] else "")
                                          for r in result["warmup"]), flush=True)
            print(f"[{clock():7.1f}s] load starts", flush=True)
            result["load_start_s"] = await load.run_timed(requests, drain, stop)
            result["load_end_s"] = clock()
            print(f"[{clock():7.1f}s] load done; probes", flush=True)
            await load.run_probes(requests, stop)
        finally:
            result.update(stop_samplers(samplers, extra))
            result["requests"] = [load.records.get(r.index) or _unsent(r) for r in requests]
            result["interrupted"] = stop.is_set()


def fit_drain(args: argparse.Namespace, workload: Workload, now: float) -> float:
    """The drain that still ends the run by ``--deadline``; NotReady if even the load cannot fit."""
    if args.deadline is None:
        return args.drain
    spare = args.deadline - now - workload.duration_s - PROBES_S - WARMUP_S
    if spare < 0:
        raise NotReady(f"only {args.deadline - now:.0f} s left after start-up, the load needs "
                       f"{workload.duration_s + PROBES_S + WARMUP_S:.0f} s (shorten --duration or start faster)")
    return min(args.drain, spare)


def _unsent(request: Request) -> dict[str, Any]:
    record = new_record(request, -1.0)
    record.update(sent_s=None, error="never sent: the run was stopped first")
    return record


def run(args: argparse.Namespace) -> int:
    workload = workload_from(args)
    if len(args.ports) != len(workload.models):
        raise WorkloadError(f"{len(workload.models)} models but {len(args.ports)} ports")
    requests = schedule(workload)
    print(describe(workload, requests), flush=True)
    servers = [Server(m, f"http://{args.host}:{p}") for m, p in zip(workload.models, args.ports)]
    result: dict[str, Any] = {
        "config": args.config, "workload": dataclasses.asdict(workload), "digest": digest(requests),
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "servers": [{"model": s.model, "url": s.url, "port": p} for s, p in zip(servers, args.ports)],
        "args": {k: v for k, v in vars(args).items() if k != "func"}, "load_start_s": 0.0}
    code = EXIT_OK
    try:
        asyncio.run(drive(args, workload, requests, servers, result))
        if args.server_logs:
            result["reclaim_log"] = read_logs(args.server_logs)
        result["summary"] = summarize(result)
        print(render(result["summary"], args.config))
        code = EXIT_FAILED if result["interrupted"] else code
    except NotReady as error:
        print(f"multi_model: {error}", file=sys.stderr)
        result["not_ready"] = str(error)
        code = EXIT_FAILED
    finally:  # whatever happened, what was gathered is kept
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result))
        print(f"result: {args.out}")
    return code


# ------------------------------------------------------------------ other commands
def load_result(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def summarize_files(paths: list[str], server_logs: str | None = None) -> int:
    if server_logs and len(paths) != 1:
        print("multi_model: --server-logs goes with one result file", file=sys.stderr)
        return EXIT_USAGE
    for path in paths:
        result = load_result(path)
        if server_logs:
            result["reclaim_log"] = read_logs(server_logs)
        if "requests" not in result:
            print(f"{path}: {result['config']} has no requests ({result.get('not_ready', 'no load ran')})")
            continue
        print(render(summarize(result), f"{result['config']} ({path})"))
    return EXIT_OK


def compare_files(reference: str, others: list[str], out: str | None) -> int:
    ref, comparisons = load_result(reference), []
    for path in others:
        comparison = comparing.compare_runs(ref, load_result(path))
        comparisons.append(comparison)
        print(comparing.render(comparison))
    if out:
        Path(out).write_text(json.dumps(comparisons, indent=1))
    same = all(comparing.probes_identical(c) for c in comparisons)
    print("probes identical in every run" if same else "PROBES DIFFER (or failed) in some run")
    return EXIT_OK if same else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "schedule":
            workload = workload_from(args)
            print(describe(workload, schedule(workload)))
            return EXIT_OK
        if args.command == "run":
            return run(args)
        if args.command == "summarize":
            return summarize_files(args.results, args.server_logs)
        return compare_files(args.reference, args.others, args.json)
    except (WorkloadError, comparing.NotComparable) as error:
        print(f"multi_model: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
