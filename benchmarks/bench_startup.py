"""Engine start-up with a large host tier against vanilla vLLM (the target: at most vanilla + 2 s).

Each configuration is one ``benchmarks/vllm_run.py`` process (its environment applies when vLLM
is imported): the time ``LLM(...)`` takes to return is the start-up; one short pass of
generation follows, so a tier still pinning in the background is seen serving. The order
alternates vanilla with the others, and a first vanilla run (left out of the table) warms the
compile cache, so no configuration pays for compiling alone.

* ``vanilla``: no host tier.
* ``kvelastic``: ``KVELASTIC_CPU_BYTES=--cpu-gib``, pinned in the background (the default).
* ``offload-lru``: vLLM's OffloadingConnector with ``cpu_bytes_to_use`` the same bytes.

For kvelastic the log line ``host tier pinned ... in X s (background)`` gives how long the
background pinning took after the tier was built. Prints a table and writes --json.

    python benchmarks/bench_startup.py --outdir $OUT/startup --json $OUT/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PINNED = re.compile(r"host tier pinned (\S+ ?\S*B) in ([0-9.]+) s")


def configs(gib: int) -> dict[str, tuple[dict[str, str], list[str]]]:
    """name: (environment, extra vllm_run.py arguments)."""
    tier = {"KVELASTIC": "1", "KVELASTIC_CPU_BYTES": f"{gib}GiB"}
    return {
        "vanilla": ({"KVELASTIC": "0"}, []),
        "kvelastic": (tier, ["--idle-after", "15"]),  # long enough for the "pinned" log line
        "offload-lru": ({"KVELASTIC": "0"}, ["--connector", "offload-lru", "--cpu-bytes", str(gib << 30)]),
    }


def run(name: str, env: dict[str, str], extra: list[str], args: argparse.Namespace) -> dict:
    out = Path(args.outdir) / f"{name}.json"
    log = Path(args.outdir) / f"{name}.log"
    cmd = [sys.executable, str(HERE / "vllm_run.py"), "--model", args.model, "--out", str(out),
           "--prompts", str(args.prompts), "--passes", "1", "--max-tokens", "32", *extra]
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    row: dict = {"config": name.rsplit(".", 1)[0], "run": name, "rc": rc,
                 "process_s": time.monotonic() - start, "gpu_free_after_s": gpu_free_after(start)}
    if rc == 0:
        data = json.loads(out.read_text())
        row.update(startup_s=data["startup_s"], pass_s=data["passes"][0]["seconds"],
                   outputs=data["passes"][0]["outputs"])
    pinned = PINNED.findall(log.read_text(errors="replace"))
    if pinned:
        row["pinned"], row["pin_s"] = pinned[-1][0], float(pinned[-1][1])
    return row


def gpu_compute_pids() -> list[str]:
    """Processes holding a GPU context; a dummy entry while nvidia-smi itself waits on the driver."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout
    except subprocess.TimeoutExpired:
        return ["nvidia-smi timed out"]
    return text.split()


def gpu_free_after(start: float, limit: float = 180.0) -> float | None:
    """Seconds from the run's start until no process holds a GPU context: a run's teardown
    (a 48 GiB pinned tier is unregistered and unmapped at exit) must not overlap the next start."""
    while gpu_compute_pids():
        if time.monotonic() - start > limit:
            return None
        time.sleep(0.2)
    return time.monotonic() - start


def table(rows: list[dict]) -> list[dict]:
    ok = [r for r in rows if r["rc"] == 0 and not r["run"].endswith(".warm")]
    base = statistics.median(r["startup_s"] for r in ok if r["config"] == "vanilla")
    reference = next(r["outputs"] for r in ok if r["config"] == "vanilla")
    summary = []
    print(f"{'config':<20}{'runs':>5}{'start-up s':>12}{'vs vanilla':>12}{'pass s':>9}{'pinned in s':>13}"
          f"{'GPU free s':>12}  identical")
    for name in dict.fromkeys(r["config"] for r in ok):
        mine = [r for r in ok if r["config"] == name]
        start = statistics.median(r["startup_s"] for r in mine)
        pin = [r["pin_s"] for r in mine if "pin_s" in r]
        same = sum(r["outputs"] == reference for r in mine)
        summary.append({"config": name, "runs": len(mine), "startup_s": start, "minus_vanilla_s": start - base,
                        "pass_s": statistics.median(r["pass_s"] for r in mine),
                        "pin_s": statistics.median(pin) if pin else None, "identical": f"{same}/{len(mine)}",
                        "gpu_free_after_s": [r["gpu_free_after_s"] for r in mine]})
        s = summary[-1]
        pin_text = f"{s['pin_s']:.2f}" if pin else "-"
        print(f"{name:<20}{len(mine):>5}{start:>12.2f}{start - base:>+12.2f}{s['pass_s']:>9.2f}"
              f"{pin_text:>13}{max(x or -1 for x in s['gpu_free_after_s']):>12.1f}  {s['identical']}")
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="scripts/models/llama-1b")
    p.add_argument("--cpu-gib", type=int, default=48)
    p.add_argument("--configs", nargs="+", default=["kvelastic", "offload-lru"])
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration, alternated with vanilla")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--outdir", default="startup")
    p.add_argument("--json", default="startup.json")
    args = p.parse_args()
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    known = configs(args.cpu_gib)
    order = ["vanilla.warm"]
    for i in range(args.repeats):
        for name in args.configs:
            order += [f"vanilla.{len(order)}", f"{name}.{len(order) + 1}"]
    rows = []
    for run_name in order:
        env, extra = known[run_name.rsplit(".", 1)[0]]
        rows.append(run(run_name, env, extra, args))
        r = rows[-1]
        print(f"{run_name}: rc={r['rc']} start-up={r.get('startup_s', float('nan')):.2f}s "
              f"pinned={r.get('pinned')} in {r.get('pin_s')} s; process {r['process_s']:.1f} s, "
              f"GPU free after {r['gpu_free_after_s']} s", flush=True)
    summary = table(rows)
    for r in rows:
        r.pop("outputs", None)
    Path(args.json).write_text(json.dumps({"cpu_gib": args.cpu_gib, "runs": rows, "summary": summary}, indent=1))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
