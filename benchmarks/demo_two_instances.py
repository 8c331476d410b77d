"""Two kvelastic vLLM servers sharing one GPU, end to end: many models on one GPU.

Starts two dummy-weight llama-1b servers with ``python3 -m kvelastic.launcher.command`` and samples
``python3 -m kvelastic.cli status --json`` every 0.25 s. Phase A loads instance 1; while it idles
with a warm prefix cache its cap is lowered at run time (``kvelastic limit``): the cache must
spill to the host tier, and the same prompts must come back token-identical. Phase B loads
instance 2, phase C both; ``kvelastic_*`` is read from each ``/metrics``. Writes demo.json,
memory.png (if matplotlib imports), launch.log and servers/*.log under --outdir and prints the
checks. Exit 0: every hard check passed; 1: one failed; 2: bad setup, nothing started.
Run from the repository root, with kvelastic installed in python3 (pip install -e . --no-deps):

    python3 benchmarks/demo_two_instances.py --outdir "$OUT" --enforce-eager
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from kvelastic.units import format_size, parse_size  # noqa: E402

sys.path.insert(0, str(HERE))
from demo_support import (  # noqa: E402
    GIB,
    NAMES,
    PROBES,
    budget_excess,
    complete,
    healthy,
    http,
    metric,
    parse_metrics,
    plot,
    prompt,
    read_status,
    run_all,
    same,
    summarize_phases,
)

CACHE_TTL_S, LIMIT_TIMEOUT_S, PERIOD_S = 600, 60.0, 0.25


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--outdir", default=os.environ.get("OUT") or "demo-out", help="default: $OUT, else ./demo-out")
    add("--model", default=str(HERE / "models" / "llama-1b"))
    add("--ports", type=int, nargs=2, default=[8001, 8002])
    add("--gpu-util", type=float, default=0.3, help="--gpu-memory-utilization of each server")
    add("--budget", default="24GiB", help="shared KV budget, below the two caps together ('none': GPU memory)")
    add("--cpu-bytes", default="8GiB", help="KVELASTIC_CPU_BYTES (host tier) of each server")
    add("--new-limit", default="1GiB", help="cap given to instance 1 at run time")
    add("--vllm-args", default="--load-format dummy --max-model-len 4096 --enable-prompt-tokens-details")
    add("--enforce-eager", action="store_true", help="start faster: no torch.compile, no CUDA graphs")
    add("--ready-timeout", type=float, default=420.0, help="seconds until both servers answer /health")
    add("--phase-s", type=float, default=20.0, help="seconds of load per phase")
    add("--gap-s", type=float, default=8.0, help="idle seconds after each phase")
    add("--concurrency", type=int, default=32, help="requests in flight per loaded instance")
    add("--max-tokens", type=int, default=64)
    add("--skip-install-check", action="store_true", help="start even if kvelastic is not pip-installed")
    return p.parse_args(argv)


# ------------------------------------------------------------------ prompts, HTTP, parsing
@functools.cache
class Demo:
    def __init__(self, args: argparse.Namespace, out: Path):
        self.args, self.out, self.t0, self.model = args, out, time.monotonic(), args.model
        self.urls = [f"http://127.0.0.1:{port}" for port in args.ports]
        self.launcher: subprocess.Popen | None = None
        self.samples: list[dict] = []
        self.halted = threading.Event()
        self.phases: list[dict] = []
        self.events: list[tuple[float, str]] = []
        self.checks: list[dict] = []
        self.data: dict[str, Any] = {"outputs": {}, "metrics": {}, "errors": []}
        self.ready = False

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def event(self, label: str) -> None:
        self.events.append((self.now(), label))
        print(f"[{self.now():7.1f}s] {label}", flush=True)

    def check(self, name: str, ok: bool, hard: bool, detail: str) -> None:
        self.checks.append({"check": name, "ok": bool(ok), "hard": hard, "detail": detail})

    def sample_forever(self) -> None:
        while not self.halted.is_set():
            began = time.monotonic()
            if sample := read_status(began - self.t0):
                self.samples.append(sample)
            self.halted.wait(max(0.0, PERIOD_S - (time.monotonic() - began)))

    def launch_command(self) -> list[str]:
        a = self.args
        vllm = shlex.split(a.vllm_args) + (["--enforce-eager"] if a.enforce_eager else [])
        cmd = [sys.executable, "-m", "kvelastic.launcher.command", "--gpu-util", str(a.gpu_util),
               "--log-dir", str(self.out / "servers"), "--startup-timeout", str(a.ready_timeout)]
        cmd += [] if a.budget.lower() == "none" else ["--budget", a.budget]
        for i, (name, port) in enumerate(zip(NAMES, a.ports, strict=True)):
            cmd += ["--and"] * (i > 0) + ["--model", self.model, "--port", str(port), "--name", name,
                                          "--env", f"KVELASTIC_CPU_BYTES={a.cpu_bytes}",
                                          "--env", f"KVELASTIC_CACHE_TTL={CACHE_TTL_S}", "--", *vllm]
        return cmd

    def start(self) -> bool:
        """Start the launcher and the sampler; wait until both servers answer /health."""
        cmd = self.launch_command()
        self.data["launch_command"] = shlex.join(cmd)
        with open(self.out / "launch.log", "wb") as log:
            self.launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        threading.Thread(target=self.sample_forever, daemon=True).start()
        self.event(f"launcher started (pid {self.launcher.pid})")
        deadline, up = time.monotonic() + self.args.ready_timeout, set()
        while len(up) < 2 and time.monotonic() < deadline and self.launcher.poll() is None:
            for i in set(range(2)) - up:
                if healthy(self.urls[i]):
                    up.add(i)
                    self.event(f"{NAMES[i]} ready")
            time.sleep(1.0)
        self.ready = len(up) == 2
        code = self.launcher.poll()
        self.check("both servers ready", self.ready, True, "" if self.ready else
                   f"{'timeout' if code is None else f'launcher exit {code}'}; see launch.log, servers/")
        if self.ready:
            self.model = json.loads(http(self.urls[0] + "/v1/models"))["data"][0]["id"]
            joined = sorted((read_status() or {}).get("members", {}))
            self.check("both joined the shared account", joined == sorted(NAMES), True, f"seen {joined}")
        return self.ready

    def member(self, name: str) -> dict:
        return ((read_status(self.now()) or {}).get("members") or {}).get(name) or {}

    def scrape(self, i: int, label: str) -> dict:
        try:
            snapshot = parse_metrics(http(self.urls[i] + "/metrics", timeout=10).decode())
        except Exception as error:  # noqa: BLE001 - recorded; the checks judge it
            snapshot = {}
            self.data.setdefault("metric_errors", []).append(f"/metrics of {NAMES[i]}: {error!r}")
        self.data["metrics"][f"{NAMES[i]} {label}"] = snapshot
        return snapshot

    def cli(self, *argv: str) -> int:
        done = subprocess.run([sys.executable, "-m", "kvelastic.cli", *argv], capture_output=True, text=True,
                              check=False)
        self.event(f"kvelastic {' '.join(argv)} -> exit {done.returncode}: {(done.stdout + done.stderr).strip()}")
        return done.returncode

    def load(self, i: int, offset: int, result: dict) -> None:
        """Closed-loop load on instance ``i`` for --phase-s seconds, counted into ``result``."""
        deadline, counter, lock = time.monotonic() + self.args.phase_s, itertools.count(offset), threading.Lock()

        def worker() -> None:
            while time.monotonic() < deadline:
                with lock:
                    index = next(counter)
                try:
                    complete(self.urls[i], self.model, prompt(index), self.args.max_tokens)
                    outcome = "requests"
                except Exception as error:  # noqa: BLE001 - counted; any failure fails a hard check
                    outcome = "errors"
                    result.setdefault("first_error", repr(error))
                    time.sleep(0.5)
                with lock:
                    result[outcome] += 1
        run_all([threading.Thread(target=worker) for _ in range(self.args.concurrency)])

    def phase(self, label: str, plan: list[tuple[int, int]]) -> dict:
        """Load the instances of ``plan`` ((index, first prompt)) together, then idle --gap-s."""
        phase = {"name": label, "kind": "load", "start": self.now(), "instances": [NAMES[i] for i, _ in plan],
                 "results": {NAMES[i]: {"requests": 0, "errors": 0} for i, _ in plan}}
        self.event(f"phase {label}: load on {', '.join(phase['instances'])}")
        run_all([threading.Thread(target=self.load, args=(i, first, phase["results"][NAMES[i]]))
                 for i, first in plan])
        phase["end"] = self.now()
        time.sleep(self.args.gap_s)
        self.phases += [phase, {"name": f"idle after {label}", "kind": "idle", "start": phase["end"],
                                "end": self.now()}]
        return phase

    def probe(self, i: int, passes: int) -> list[dict]:
        """The probe prompts one at a time (the same batch shape each time); the last pass."""
        results: list[dict] = []
        for _ in range(passes):
            results = []
            for index in range(PROBES):
                try:
                    results.append(complete(self.urls[i], self.model, prompt(index), self.args.max_tokens))
                except Exception as error:  # noqa: BLE001 - an error never matches an output
                    self.data["errors"].append(f"probe {index} on {NAMES[i]}: {error!r}")
                    results.append({"key": f"error {error!r}", "by": "error"})
        return results


def limit_step(demo: Demo) -> list[dict]:
    """Lower instance 1's cap while its prefix cache is warm: spill, reload, identical outputs."""
    name, new = NAMES[0], parse_size(demo.args.new_limit)
    reference = demo.probe(0, passes=2)  # second pass: every full prompt block is a prefix hit
    before, m0 = demo.member(name), demo.scrape(0, "before limit")
    demo.event(f"cap {name} -> {demo.args.new_limit}")
    started = time.monotonic()
    rc, latency = demo.cli("limit", name, demo.args.new_limit), None
    while latency is None and time.monotonic() - started < LIMIT_TIMEOUT_S:
        if demo.member(name).get("mapped_bytes", new + 1) <= new:
            latency = round(time.monotonic() - started, 3)
        time.sleep(0.05)
    time.sleep(1.0)  # host bytes reach the account on the instance's next ticks
    after, m1 = demo.member(name), demo.scrape(0, "after limit")
    replay = demo.probe(0, passes=1)
    m2 = demo.scrape(0, "after replay")
    demo.cli("limit", name, str(before.get("max_bytes") or "none"))  # back to the start-up cap
    demo.event(f"cap {name} restored")
    delta = {k: (metric(y, f"kvelastic_{k}", name) or 0) - (metric(x, f"kvelastic_{k}", name) or 0)
             for k, x, y in (("spilled_bytes", m0, m1), ("reloaded_bytes", m1, m2), ("host_hits", m1, m2))}
    was, host = before.get("mapped_bytes", 0), (before.get("host_bytes", 0), after.get("host_bytes", 0))
    demo.data["limit_change"] = {"new_limit_bytes": new, "cli_exit": rc, "latency_s": latency,
                                 "before": before, "after": after, "metric_deltas": delta}
    demo.data["outputs"].update(reference=reference, replay=replay)
    demo.check("lowered cap held at run time", rc == 0 and latency is not None, True,
               f"{format_size(was)} -> <= {demo.args.new_limit} after {latency} s")
    demo.check("cache was above the new cap", was > new, False, "else the limit step proves little")
    demo.check("cache spilled to the host tier", delta["spilled_bytes"] > 0 or host[1] > host[0], False,
               f"spilled +{format_size(delta['spilled_bytes'])}, host {format_size(host[0])} -> {format_size(host[1])}")
    demo.check("replay reloaded from the host tier", delta["reloaded_bytes"] > 0, False,
               f"reloaded +{format_size(delta['reloaded_bytes'])}, host hits +{delta['host_hits']:.0f}")
    n, total = same(reference, replay)
    demo.check("outputs identical after spill/reload", n == total > 0, True,
               f"{n}/{total} identical, by {reference[0]['by']}")
    return reference


def scenario(demo: Demo) -> None:
    demo.phase("A", [(0, 0)])
    reference = limit_step(demo)
    demo.phase("B", [(1, 0)])
    other = demo.data["outputs"]["instance_2"] = demo.probe(1, passes=2)
    n, total = same(reference, other)
    demo.check("both instances give the same outputs", n == total, False, f"{n}/{total} identical (info)")
    demo.phase("C", [(0, 100_000), (1, 200_000)])
    for i, name in enumerate(NAMES):
        found = demo.scrape(i, "end")
        demo.check(f"kvelastic_* on /metrics of {name}", metric(found, "kvelastic_mapped_bytes", name) is not None,
                   False, ", ".join(sorted(found)) or "none")
    alive = demo.launcher.poll() is None and all(healthy(url) for url in demo.urls)
    demo.check("both servers alive at the end", alive, True, "" if alive else f"launcher: {demo.launcher.poll()}")


# ------------------------------------------------------------------ stop, judge, report
def stop_launcher(launcher: subprocess.Popen | None, log: Path) -> str:
    """SIGINT to the launcher's group (it stops its servers), then SIGTERM, SIGKILL; then orphans."""
    sent: list[str] = []
    for signum, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if launcher is None or launcher.poll() is not None:
            break
        sent.append(signum.name)
        try:
            os.killpg(launcher.pid, signum)
            launcher.wait(timeout=wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue
    if "SIGKILL" in sent:  # the launcher could not stop its servers: kill their process groups
        for pid in re.findall(r"starting pid (\d+)", log.read_text(errors="replace")):
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return "launcher never started" if launcher is None else f"launcher exit {launcher.poll()} ({sent})"


def judge(demo: Demo) -> None:
    if not demo.ready:  # the start-up failure is the one check that matters; show the logs
        for log in [demo.out / "launch.log", *sorted((demo.out / "servers").glob("*.log"))]:
            print(f"--- last lines of {log}:", *log.read_text(errors="replace").splitlines()[-25:], sep="\n")
        return
    excess, over = budget_excess(demo.samples)
    crash = demo.data.get("crash", "").strip().splitlines()[-1:]
    demo.check("ran to the end", not crash, True, crash[0] if crash else "")
    demo.check("status sampled", len(demo.samples) > 10, True, f"{len(demo.samples)} samples")
    demo.check("sum of mapped bytes <= budget", bool(demo.samples) and over == 0, True,
               f"max excess {format_size(max(excess, 0))} in {over} samples")
    results = [r for p in demo.phases if p["kind"] == "load" for r in p["results"].values()]
    errors = sum(r["errors"] for r in results) + len(demo.data["errors"])
    demo.check("no failed requests", demo.ready and errors == 0, True,
               f"{sum(r['requests'] for r in results)} ok, {errors} failed")
    summarize_phases(demo.phases, demo.samples)
    for phase in (p for p in demo.phases if p["kind"] == "load"):
        grew = any(phase["mapped"][n]["peak"] > phase["mapped"][n]["start"] for n in phase["instances"])
        demo.check(f"phase {phase['name']}: a loaded instance grew", grew, False, "; ".join(
            f"{n} {v['start'] / GIB:.2f}/{v['peak'] / GIB:.2f}/{v['end'] / GIB:.2f}"
            for n, v in phase["mapped"].items()) + " GiB mapped start/peak/end")


def report(demo: Demo, stop: str) -> int:
    png = plot(demo, demo.out / "memory.png") if demo.samples else "skipped: no samples"
    record = {"args": vars(demo.args), "stop": stop, "events": demo.events, "phases": demo.phases,
              "checks": demo.checks, "plot": png, "samples": demo.samples, **demo.data}
    (demo.out / "demo.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"\n{'check':<42} {'result':<6} {'kind':<4} detail")
    for c in demo.checks:
        print(f"{c['check']:<42} {'PASS' if c['ok'] else 'FAIL':<6} {'hard' if c['hard'] else 'soft':<4} {c['detail']}")
    print(f"\n{stop}; plot: {png}; all data: {demo.out / 'demo.json'}")
    return int("crash" in demo.data or any(c["hard"] and not c["ok"] for c in demo.checks))


def setup_problem(args: argparse.Namespace) -> str | None:
    """Why the demo cannot start (a bad size, kvelastic not installed for vLLM's plugins), or None."""
    from importlib import metadata

    try:
        [parse_size(s) for s in (args.new_limit, args.cpu_bytes, args.budget) if s.lower() != "none"]
    except ValueError as error:
        return str(error)
    plugins = [ep.value for ep in metadata.entry_points(group="vllm.general_plugins")]
    if not args.skip_install_check and not any(value.startswith("kvelastic") for value in plugins):
        return "kvelastic is not installed in this Python, so KVELASTIC=1 would do nothing in vLLM " \
               "(pip install -e . --no-deps, or --skip-install-check)"
    return None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := setup_problem(args):
        print(f"demo: {problem}", file=sys.stderr)
        return 2
    (out := Path(args.outdir)).mkdir(parents=True, exist_ok=True)
    demo = Demo(args, out)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the launcher must not inherit an ignored SIGINT
    try:
        if demo.start():
            scenario(demo)
    except BaseException as error:  # noqa: BLE001 - Ctrl-C included: the servers are always stopped
        demo.data["crash"] = "".join(traceback.format_exception(error))
        print(demo.data["crash"], file=sys.stderr)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a repeated signal must not cut the stop short
            signal.signal(signum, signal.SIG_IGN)
        demo.halted.set()
        stop = stop_launcher(demo.launcher, out / "launch.log")
        demo.event(stop)
    judge(demo)
    return report(demo, stop)


if __name__ == "__main__":
    sys.exit(main())
