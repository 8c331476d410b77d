"""Multi-turn chat benchmark: vanilla vLLM, vLLM's OffloadingConnector (LRU, ARC) and kvelastic.

Many conversations; each turn re-sends the whole growing history plus a new
user message. All configurations get the same GPU KV budget (vanilla and the
connector through --kv-cache-memory-bytes, kvelastic through KVELASTIC_LIMIT)
and the same CPU bytes. The histories together are well above the GPU budget
and within the CPU budget, so what a configuration keeps (and reloads) decides
how much it recomputes. Prints a table and writes JSON.

    python benchmarks/bench_multiturn.py --model scripts/models/llama-1b --json $OUT/multiturn.json

``--configs ... ideal`` adds vanilla vLLM holding the GPU and CPU budgets together on the GPU: no
offload, no recompute, the bound for every other configuration (its engine needs that much memory).

``--interleave`` starts every configuration's engine at once and deals the rounds out in turn
(:mod:`round_baton`), so that each round of one configuration has a neighbour of every other, and
prints each configuration's throughput against the first's as the median of per-round ratios:
the machine's drift, which moved whole stretches of rounds by up to a third, cancels in them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from percentiles import percentile  # beside this file, as run_proof (the repo root on sys.path would
from round_baton import Conductor, Player
from run_proof import inactive_reason  # shadow kvelastic)
from variants import parse_variant

CONFIGS = ("vanilla", "offload-lru", "offload-arc", "kvelastic")
#: On request: kvelastic with KVELASTIC_CPU_POLICY=lru; ``ideal``, vanilla vLLM with the GPU and CPU budgets
#: together on the GPU: nothing to offload or recompute, the bound any host tier can only approach.
OPTIONAL = ("kvelastic-lru", "ideal")
# With --interleave a kvelastic engine waits out the others' rounds (about 13 s for three engines), longer
# than its idle TTL (10 s): it would give its pages back and spill its cache beside another engine's round,
# which it never does when its rounds run back to back. Its TTL outlasts the run instead (unless set).
IDLE_TTL_INTERLEAVED = "3600"


def conversations(n: int, first: int, turn: int, seed: int = 7) -> list[list[list[int]]]:
    """For each conversation, the new user tokens of each turn (turn 0 is the long system+first message)."""
    rng = random.Random(seed)
    return [[[rng.randrange(1000, 100000) for _ in range(first if t == 0 else turn)] for t in range(64)]
            for _ in range(n)]


def run_one(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    kw = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0,
              gpu_memory_utilization=memory_share(args), max_model_len=args.max_model_len, enable_prefix_caching=True,
              disable_log_stats=False)
    if not args.config.startswith("kvelastic"):
        kw["kv_cache_memory_bytes"] = vllm_kv_bytes(args)
    if args.config.startswith("offload"):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"block_size": 16, "cpu_bytes_to_use": args.cpu_bytes,
                                       "eviction_policy": args.config.split("-")[1]})
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True)
    player = Player(args.baton, args.config) if args.baton else None
    if player:
        player.ready()
    rounds = []
    for r in range(args.warmup + args.rounds):
        if player:
            player.wait_turn(r)
        started, start = time.time(), time.perf_counter()
        turns = one_round(llm, params, conversations(args.conversations, args.first_len, args.turn_len, seed=7 + r),
                          args.turns)
        rounds.append({"round": r, "warmup": r < args.warmup, "seconds": time.perf_counter() - start,
                       "started": started, "turns": turns})
        # the rounds so far on disk: a device call cut short still leaves them to --collect-only
        Path(args.outdir, f"{args.config}.json").write_text(json.dumps({"config": args.config, "rounds": rounds}))
        if player:
            player.done(r)
    return {"config": args.config, "rounds": rounds}


def vllm_kv_bytes(args: argparse.Namespace) -> int:
    """The KV cache a vanilla or connector engine is given (kvelastic's is ``KVELASTIC_LIMIT``): the GPU
    budget; for ``ideal`` the GPU and CPU budgets both, so that the histories never leave the GPU."""
    return args.gpu_kv_bytes + (args.cpu_bytes if args.config == "ideal" else 0)


def memory_share(args: argparse.Namespace) -> float:
    """vLLM's ``gpu_memory_utilization``: each engine's share when several live at once (vLLM refuses to
    start if less than its share is free); the KV budgets are set in bytes either way."""
    if args.gpu_memory_utilization is not None:
        return args.gpu_memory_utilization
    return round(0.8 / (len(args.configs) + len(args.variant)), 3) if args.interleave else 0.9


def one_round(llm: Any, params: Any, convs: list[list[list[int]]], turns: int) -> list[dict]:
    """Every conversation's turns in order, each turn re-sending the whole history."""
    from vllm import TokensPrompt

    histories: list[list[int]] = [[] for _ in convs]
    out = []
    for t in range(turns):
        prompts = [h + c[t] for h, c in zip(histories, convs)]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        for i, o in enumerate(outs):
            histories[i] = prompts[i] + list(o.outputs[0].token_ids)
        metrics = [o.metrics for o in outs if o.metrics]
        out.append({"seconds": elapsed, "prompt_tokens": sum(len(p) for p in prompts),
                    "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                    "ttft": [m.first_token_latency for m in metrics], **engine_waits(metrics),
                    "outputs": [list(o.outputs[0].token_ids) for o in outs]})
    return out


def engine_waits(metrics: list) -> dict[str, list[float]]:
    """Each request's TTFT split at its first scheduling, from the engine core's timestamps: ``queued``
    (queued to first scheduled: waiting for room, or for its host or connector loads) and ``scheduled``
    (first scheduled to first token: its prefill steps). Empty where the release does not stamp them."""
    stamps = [(getattr(m, "queued_ts", 0.0), getattr(m, "scheduled_ts", 0.0), getattr(m, "first_token_ts", 0.0))
              for m in metrics]
    if not stamps or not all(q and s and f for q, s, f in stamps):
        return {}
    return {"queued": [s - q for q, s, _ in stamps], "scheduled": [f - s for _, s, f in stamps]}


def round_summary(rnd: dict, out_len: int) -> dict:
    turns = rnd["turns"]
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns[1:])
    later_prompt = sum(t["prompt_tokens"] for t in turns[1:])
    ttft = sorted(x for t in turns[1:] for x in t["ttft"])
    outputs = sum(len(t["outputs"]) for t in turns) * out_len
    return {"seconds": rnd["seconds"], "tok_s": (prompt + outputs) / rnd["seconds"],
            "ttft_p50": statistics.median(ttft), "ttft_p99": percentile(ttft, 99),
            "prefix_hit_ratio": cached / later_prompt}


def summarize(r: dict, out_len: int) -> dict:
    """Medians over the measured rounds (warm-up rounds left out), and the spread of throughput.

    TTFT is also pooled: every later-turn request of every measured round in
    one distribution (``pooled_p50`` ...), steadier than a median of three
    per-round medians.
    """
    measured = [rnd for rnd in r["rounds"] if not rnd["warmup"]]
    per_round = [round_summary(rnd, out_len) for rnd in measured]
    row: dict[str, Any] = {"config": r["config"], "rounds": per_round}
    for key in ("seconds", "tok_s", "ttft_p50", "ttft_p99", "prefix_hit_ratio"):
        row[key] = statistics.median(x[key] for x in per_round)
    row["tok_s_min"], row["tok_s_max"] = min(x["tok_s"] for x in per_round), max(x["tok_s"] for x in per_round)
    pooled = sorted(x for rnd in measured for t in rnd["turns"][1:] for x in t["ttft"])
    for q in (50, 90, 99):
        row[f"pooled_p{q}"] = percentile(pooled, q)
    return row


def identical(a: dict, b: dict) -> tuple[int, int]:
    same = total = 0
    for ra, rb in zip(a["rounds"], b["rounds"]):
        for ta, tb in zip(ra["turns"], rb["turns"]):
            same += sum(x == y for x, y in zip(ta["outputs"], tb["outputs"]))
            total += len(ta["outputs"])
    return same, total


def launch(config: str, args: argparse.Namespace, variants: dict[str, dict[str, str]],
           baton: str | None = None) -> subprocess.Popen:
    """This configuration's engine process, with its environment; its output goes to ``<config>.log``."""
    env = dict(os.environ, KVELASTIC="1" if config.startswith("kvelastic") else "0",
               KVELASTIC_LIMIT=str(args.gpu_kv_bytes), KVELASTIC_CPU_BYTES=str(args.cpu_bytes),
               KVELASTIC_CPU_POLICY="lru" if config == "kvelastic-lru" else "arc")
    if not args.cpu_bytes:  # kvelastic without a host tier (an A/B of what is not offload)
        del env["KVELASTIC_CPU_BYTES"]
    if baton and config.startswith("kvelastic") and "KVELASTIC_CACHE_TTL" not in os.environ:
        env["KVELASTIC_CACHE_TTL"] = IDLE_TTL_INTERLEAVED
    env.update(variants.get(config, {}))
    cmd = [sys.executable, __file__, "--config", config, *sys.argv[1:], *(["--baton", baton] if baton else [])]
    with open(Path(args.outdir, f"{config}.log"), "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def finished(config: str, process: subprocess.Popen, args: argparse.Namespace) -> bool:
    """Wait for the engine's process: True if it exited cleanly, else say where its log is."""
    if process.wait() == 0:
        return True
    print(f"{config}: FAILED (exit {process.returncode}), see {args.outdir}/{config}.log")
    return False


def run_sequential(configs: list[str], args: argparse.Namespace, variants: dict[str, dict[str, str]]) -> list[str]:
    """One engine after another, each through all its rounds; return the configurations that finished."""
    return [config for config in configs if finished(config, launch(config, args, variants), args)]


def run_interleaved(configs: list[str], args: argparse.Namespace, variants: dict[str, dict[str, str]]) -> list[str]:
    """Every engine at once, the rounds dealt out in turn; return the configurations that finished."""
    baton = tempfile.mkdtemp(prefix="multiturn-baton-")
    players = {config: launch(config, args, variants, baton) for config in configs}
    conductor = Conductor(baton, players)
    print("engines up: " + " ".join(conductor.wait_ready()), flush=True)
    for r in range(args.warmup + args.rounds):
        print(f"round {r}: " + " ".join(conductor.play_round(r)), flush=True)
    done = [config for config, process in players.items() if finished(config, process, args)]
    shutil.rmtree(baton, ignore_errors=True)
    return done


def print_paired(rows: list[dict]) -> None:
    """Each configuration against the first, round by round (their rounds ran side by side): the medians
    and ranges of the per-round ratios of throughput and of TTFT p50. Stored in ``row["paired"]``."""
    base = rows[0]
    print(f"paired with {base['config']}, round by round: median (min-max) of the per-round ratios")
    for row in rows[1:]:
        tok = [a["tok_s"] / b["tok_s"] for a, b in zip(row["rounds"], base["rounds"])]
        p50 = [a["ttft_p50"] / b["ttft_p50"] for a, b in zip(row["rounds"], base["rounds"])]
        row["paired"] = {"with": base["config"], "tok_s_ratios": tok, "ttft_p50_ratios": p50}
        print(f"  {row['config']:<16} tok/s {statistics.median(tok):.3f}x ({min(tok):.3f}-{max(tok):.3f})"
              f"  TTFT p50 {statistics.median(p50):.3f}x ({min(p50):.3f}-{max(p50):.3f})"
              f"  rounds ahead {sum(x > 1 for x in tok)}/{len(tok)}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="scripts/models/llama-1b")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS + OPTIONAL)
    p.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                   help="one more kvelastic config, kvelastic-NAME, with these environment settings")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=1024)
    p.add_argument("--turn-len", type=int, default=256)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--gpu-kv-bytes", type=int, default=2 << 30)
    p.add_argument("--cpu-bytes", type=int, default=16 << 30,
                   help="host bytes of the connectors and of kvelastic's tier (0: kvelastic without one)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds, each with new conversations (median)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and left out")
    p.add_argument("--outdir", default="multiturn")
    p.add_argument("--json", default="multiturn.json")
    p.add_argument("--collect-only", action="store_true", help="tabulate <outdir>/<config>.json of an earlier run")
    p.add_argument("--interleave", action="store_true",
                   help="start every engine first, then run the rounds in turn (paired per-round ratios)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="each engine's vLLM share (default 0.9; with --interleave 0.8 over the engines)")
    p.add_argument("--baton", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.config:
        Path(args.outdir, f"{args.config}.json").write_text(json.dumps(run_one(args)))
        return 0
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    variants = dict(parse_variant(text) for text in args.variant)
    configs = [*args.configs, *variants]
    if args.collect_only:
        done = configs
    elif args.interleave:
        done = run_interleaved(configs, args, variants)
    else:
        done = run_sequential(configs, args, variants)
    rows, results = [], {}
    for config in done:
        log = Path(args.outdir, f"{config}.log")
        if not args.collect_only and config.startswith("kvelastic") and (reason := inactive_reason(log)):
            print(f"{config}: FAILED: {reason}")
            continue
        results[config] = json.loads(Path(args.outdir, f"{config}.json").read_text())
        rows.append(summarize(results[config], args.out_len))
    # outputs against vanilla's, or (without it) the first configuration's: greedy, so all must agree
    reference = "vanilla" if "vanilla" in results else next(iter(results), "vanilla")
    base = results.get(reference)
    print(f"{'config':<13} {'tok/s':>9} {'(min-max)':>17} {'TTFT p50':>9} {'TTFT p99':>9} {'pooled p50/p90/p99':>20} "
          f"{'prefix hits':>12} {'same as ' + reference:>16}")
    for row in rows:
        same, total = identical(base, results[row["config"]]) if base else (0, 0)
        row["identical"] = [same, total]
        pooled = f"{row['pooled_p50']:.3f}/{row['pooled_p90']:.3f}/{row['pooled_p99']:.3f}"
        print(f"{row['config']:<13} {row['tok_s']:>9.0f} {row['tok_s_min']:>8.0f}-{row['tok_s_max']:<8.0f} "
              f"{row['ttft_p50']:>9.3f} {row['ttft_p99']:>9.3f} {pooled:>20} {row['prefix_hit_ratio']:>12.3f} "
              f"{same:>9}/{total:<6}")
    print(f"medians of {args.rounds} rounds after {args.warmup} warm-up round(s) (pooled: all later-turn requests "
          "of those rounds); outputs compared in all rounds")
    if args.interleave and len(rows) > 1:
        print_paired(rows)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
