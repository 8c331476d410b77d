"""kvelastic's overhead on vLLM throughput and TTFT, and the physical chunk size that costs least.

Runs the same workload (8B shape by default: random prompts of 1k-4k tokens,
256 output tokens, enough requests to fill the KV cache) on vanilla vLLM and
on kvelastic with each chunk size, one engine per process, in one invocation.
Prints a table (throughput, ratio to vanilla, median TTFT, identical outputs)
and writes JSON; exits 1 if a run failed or an output differs from vanilla's.

    python benchmarks/bench_overhead.py --model scripts/models/llama-8b --chunks 2 8 32 --json $OUT/overhead.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_check import compare, run, summary  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="scripts/models/llama-8b")
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 8, 32], help="chunk sizes in MiB")
    p.add_argument("--no-vanilla", action="store_true")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--gpu-util", type=float, default=0.4)
    p.add_argument("--outdir", default="overhead")
    p.add_argument("--json", default="overhead.json")
    args = p.parse_args()
    workload = ["--prompts", str(args.requests), "--min-len", "1000", "--max-len", "4000",
                "--shared-prefix", "0", "--max-tokens", "256", "--passes", "1",
                "--gpu-util", str(args.gpu_util), "--max-model-len", "8192"]
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    if not args.no_vanilla:
        runs["vanilla"] = run("v2", False, args.model, outdir, workload, {})
    for chunk in args.chunks:
        runs[f"kvelastic-{chunk}MiB"] = run("v2", True, args.model, outdir, workload,
                                            {"KVELASTIC_CHUNK_SIZE": f"{chunk}MiB"}, f"-{chunk}MiB")
    base = runs.get("vanilla")
    rows, failed = [], False
    print(f"{'run':<18} {'tok/s':>9} {'vs vanilla':>10} {'TTFT p50 s':>11} {'peak GiB':>9} {'identical':>10}")
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<18} FAILED {r['error']}\n{r['log_tail'][-2000:]}")
            failed = True
            continue
        s = summary(r)
        ratio = s["tok_s"] / summary(base)["tok_s"] if base and "error" not in base else float("nan")
        same = compare(base, r) if base and "error" not in base else (0, 0)
        failed |= same[0] != same[1]
        rows.append({"run": name, **s, "ratio": ratio, "identical": same})
        print(f"{name:<18} {s['tok_s']:>9.0f} {ratio:>10.4f} {s['ttft_p50']:>11.3f} {s['peak_gib']:>9.1f} "
              f"{same[0]:>5}/{same[1]:<4}")
    Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
