"""Compare vLLM runs with and without kvelastic: greedy outputs must be token-identical.

Runs ``benchmarks/vllm_run.py`` once per configuration (each in its own process),
then prints a table of configurations, token agreement, timings and peak GPU
memory, and writes every run's JSON under --outdir.

    python benchmarks/e2e_check.py --model scripts/models/llama-1b --outdir $OUT/e2e --matrix v2 v1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from run_proof import inactive_reason  # beside this file (the repo root on sys.path would shadow kvelastic)
from variants import parse_variant  # beside this file

HERE = Path(__file__).resolve().parent
CONFIGS = {
    "v2": [],
    "v1": ["--v1"],
    "v2-offload": ["--offload"],
    "v1-offload": ["--v1", "--offload"],
    "v2-eager": ["--eager"],
    "mp1": ["--mp"],            # TP=1 through the multiprocess executor: the worker is another process
    "v1-mp1": ["--v1", "--mp"],
    "tp2": ["--tp", "2"],
    "tp4": ["--tp", "4"],       # a 4-GPU machine
    "v1-tp2": ["--v1", "--tp", "2"],
    "pp2": ["--pp", "2"],       # two pipeline stages
    "ray-tp2": ["--tp", "2", "--executor", "ray"],  # Ray's executor (V2 by default from vLLM 0.21): needs ray
    # vLLM's own offload connectors; vllm_run.py counts the blocks each stores and loads
    "simple-eager": ["--connector", "simple-eager"],
    "simple-lazy": ["--connector", "simple-lazy"],
    "offload-lru": ["--connector", "offload-lru"],
    "offload-arc": ["--connector", "offload-arc"],
    "lmcache": ["--connector", "lmcache"],  # a bundle with lmcache (its kernels built for the bundle's torch)
}


def run(name: str, kvelastic: bool, model: str, outdir: Path, extra: list[str], env_extra: dict,
        label: str = "") -> dict:
    out = outdir / f"{Path(model).name}-{name}-{'kve' if kvelastic else 'vanilla'}{label}.json"
    env = dict(os.environ, KVELASTIC="1" if kvelastic else "0", PYTHONFAULTHANDLER="1", **env_extra)
    cmd = [sys.executable, str(HERE / "vllm_run.py"), "--model", model, "--out", str(out), *CONFIGS[name], *extra]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        return {"error": f"exit {proc.returncode}", "log_tail": tail}
    if kvelastic and (reason := inactive_reason(log)):
        return {"error": reason, "log_tail": ""}
    return json.loads(out.read_text())


def summary(r: dict) -> dict:
    first = r["passes"][0]
    ttft = sorted(first["ttft_s"]) or [float("nan")]
    memory = r["memory"]
    ready = next((t for t, mark in r.get("marks", []) if mark == "engine ready"), memory[0][0])
    at_ready = [m for t, m in memory if t <= ready] or [memory[0][1]]
    row = {"seconds": first["seconds"], "tok_s": (first["output_tokens"] + first["prompt_tokens"]) / first["seconds"],
           "out_tok_s": first["output_tokens"] / first["seconds"], "ttft_p50": ttft[len(ttft) // 2],
           "ready_gib": at_ready[-1] / 2**30, "peak_gib": max(m for _, m in memory) / 2**30,
           "end_gib": memory[-1][1] / 2**30}
    if len(r["passes"]) > 1:  # the same prompts again: the cache is warm
        row["warm_seconds"] = r["passes"][1]["seconds"]
    # prompt tokens served from the prefix cache, per pass (None where vLLM reports none)
    row["cached_tokens"] = [sum(n or 0 for n in p.get("cached_tokens") or []) for p in r["passes"]]
    per_gpu = r.get("memory_per_gpu") or []
    if per_gpu and len(per_gpu[0][1]) > 1:  # several GPUs: each one's peak and its last sample
        row["peak_gib_per_gpu"] = [max(s[1][i] for s in per_gpu) / 2**30 for i in range(len(per_gpu[0][1]))]
        row["end_gib_per_gpu"] = [v / 2**30 for v in per_gpu[-1][1]]
    return row


def warm_ratio(vanilla: dict, elastic: dict) -> str:
    """kvelastic's speed on the second (warm) pass as a multiple of vanilla's ("-" with one pass)."""
    if "warm_seconds" not in vanilla or "warm_seconds" not in elastic:
        return "-"
    return f"{vanilla['warm_seconds'] / elastic['warm_seconds']:.3f}"


def compare(a: dict, b: dict) -> tuple[int, int]:
    same = total = 0
    for pa, pb in zip(a["passes"], b["passes"]):
        for oa, ob in zip(pa["outputs"], pb["outputs"]):
            total += 1
            same += oa == ob
    return same, total


def compare_run(name: str, vanilla: dict, elastic: dict, suffix: str) -> dict | None:
    """One table row: kvelastic's run against vanilla's (None, after printing why, if it failed)."""
    if "error" in elastic:
        print(f"== {name}{suffix} kvelastic FAILED: {elastic['error']}\n{elastic['log_tail']}")
        return None
    same, total = compare(vanilla, elastic)
    counted = elastic.get("connector")
    if counted is not None and not counted["external_tokens"]:
        print(f"== {name}{suffix}: the connector served nothing on kvelastic: the workload did not exercise it")
        return None
    return {"config": name + suffix, "identical": same, "total": total,
            "vanilla": summary(vanilla), "kvelastic": summary(elastic),
            "connector": {"vanilla": vanilla.get("connector"), "kvelastic": elastic.get("connector")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--outdir", required=True)
    p.add_argument("--matrix", nargs="+", default=["v2"], choices=sorted(CONFIGS))
    p.add_argument("--label", default="", help="suffix for output file names")
    p.add_argument("--kve-env", nargs="*", default=[], help="KEY=VALUE set for the kvelastic runs only")
    p.add_argument("--variant", "--kve-variant", dest="variant", action="append", default=[],
                   metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                   help="another kvelastic run against the same vanilla run, with these settings added to "
                        "--kve-env's (A/Bs in one call: machines differ from call to call)")
    p.add_argument("--summary", default=None, help="write the table as JSON here")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    rows, failed = [], False
    kve_env = dict(item.split("=", 1) for item in args.kve_env)
    variants = [("", kve_env)] + [(config[len("kvelastic"):], {**kve_env, **env})  # "kvelastic-NAME" -> "-NAME"
                                  for config, env in map(parse_variant, args.variant)]
    for name in args.matrix:
        vanilla = run(name, False, args.model, outdir, args.extra, {}, args.label)
        if "error" in vanilla:
            print(f"== {name} vanilla FAILED: {vanilla['error']}\n{vanilla['log_tail']}")
            failed = True
            continue
        for suffix, env in variants:
            row = compare_run(name, vanilla, run(name, True, args.model, outdir, args.extra, env,
                                                 args.label + suffix), suffix)
            failed |= row is None or row["identical"] != row["total"]
            if row is not None:
                rows.append(row)
    print(f"\n{'config':<12} {'identical':>9} {'tok/s van':>10} {'tok/s kve':>10} {'ratio':>6} "
          f"{'warm ratio':>10} {'TTFT50 van':>11} {'TTFT50 kve':>11} {'peak GiB van':>13} {'GiB kve ready/peak/end':>23}")
    for row in rows:
        v, k = row["vanilla"], row["kvelastic"]
        print(f"{row['config']:<12} {row['identical']:>4}/{row['total']:<4} {v['tok_s']:>10.0f} {k['tok_s']:>10.0f} "
              f"{k['tok_s'] / v['tok_s']:>6.3f} {warm_ratio(v, k):>10} {v['ttft_p50']:>11.3f} {k['ttft_p50']:>11.3f} "
              f"{v['peak_gib']:>13.1f} {k['ready_gib']:>9.1f} / {k['peak_gib']:.1f} / {k['end_gib']:.1f}")
    for row in rows:
        print(f"{row['config']:<12} prefix-cache hits per pass (tokens): vanilla {row['vanilla']['cached_tokens']}, "
              f"kvelastic {row['kvelastic']['cached_tokens']}")
        for label in ("vanilla", "kvelastic"):
            if row["connector"][label]:
                print(f"{row['config']:<12} {label:<9} connector {row['connector'][label]}")
            if "peak_gib_per_gpu" in row[label]:
                print(f"{row['config']:<12} {label:<9} per-GPU peak GiB "
                      f"{[round(v, 1) for v in row[label]['peak_gib_per_gpu']]}, at the end "
                      f"{[round(v, 1) for v in row[label]['end_gib_per_gpu']]}")
    if args.summary:
        Path(args.summary).write_text(json.dumps(rows, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
