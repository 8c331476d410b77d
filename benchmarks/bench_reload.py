"""TTFT of a 16k-token prefix served from the host tier vs recomputed (8B shape).

Each configuration runs in its own subprocess (so its environment applies when vLLM is
imported) and writes ``<outdir>/<config>.json``; this process prints a table and writes --json.

* ``vanilla``: vLLM with prefix caching: cold TTFT (the prefix is recomputed) and GPU-hit TTFT.
* ``kvelastic``: ``KVELASTIC=1``, ``KVELASTIC_CPU_BYTES=--cpu-bytes``, ``KVELASTIC_CACHE_TTL=--ttl``.
  The engine idles ``--wait`` seconds after the prefix was used: the reclaimer (a tick every
  0.25 s) spills the groups holding only the idle cached prefix to the host tier and unmaps
  them, so the next request with that prefix is served from the host tier. kvelastic's stats
  snapshot (``stats-<pid ns>-<pid>-<start>-<n>.json`` in this user's folder under ``/dev/shm``)
  is read around each reload: a reload is "verified" when vLLM counted the prefix as cached
  and the host tier had a hit for every prefix block (a quiet recompute or a GPU hit would fail this).
* ``offload-arc``: vLLM's OffloadingConnector (ARC, block size 16 as in bench_multiturn.py,
  ``cpu_bytes_to_use=--cpu-bytes``). After ``--settle`` seconds (its asynchronous stores finish;
  the engine keeps stepping while they are pending) ``LLM.reset_prefix_cache()`` drops the GPU
  copy and keeps the connector's CPU store (``reset_connector`` is False), so the next request
  is a CPU hit loaded by the connector. Evicting by filler prompts under a small
  ``kv_cache_memory_bytes`` would do the same, slower and less surely. Verified: the reset
  succeeded and vLLM counted the prefix as cached.

Per repetition (``--reps`` distinct seeded random prefixes, after ``--warmup`` discarded ones):
cold ``P+s0`` (TTFT); ``P+s0`` with ``--check-tokens`` greedy tokens (GPU hit: the reference);
[off the GPU]; ``P+s1`` (reload TTFT); ``P+s2`` (GPU-hit TTFT); [off the GPU again]; ``P+s0``
with ``--check-tokens`` tokens, served from the host/CPU tier. "identical": those tokens equal
the reference; "1st=cold": their first token equals the cold run's (the cold run makes one
token only, so that its wall time stays a TTFT). vanilla has no off-GPU steps: where the others
reload ``P+s1`` it idles ``--wait`` seconds (and sends ``--busy-before``'s request) and serves
``P+s1`` from its GPU cache ("hit after idle"), the engine's own cost of a reload's request on an
engine in that state; a reload can only add its copy to it. kvelastic's rows also give the
reload's copies' own time on the copy stream (its copy clock). TTFT is the wall time of
``llm.generate`` with ``max_tokens=1`` (prefill + first token); vLLM's own first-token latency is
recorded too. Medians over the repetitions.

    python benchmarks/bench_reload.py --outdir $OUT/reload --json $OUT/reload.json

``--busy-before S`` (default 0: off): S seconds before each reload, after the prefix went off the
GPU, a short request of other tokens (one output token) makes the engine busy, as other traffic
would on a server; the reload then finds what a busy engine keeps warm (its warm reserve, grown to
cover the host runs reloaded lately) instead of an idle engine's nothing. Keep S under a second
(kvelastic counts an engine busy for max(``--ttl``, 1) s after its last allocation) and above two
upkeep ticks (0.5 s). Every configuration gets the same request.

``--variant NAME:KVELASTIC_VAR=VALUE[,...]`` adds a kvelastic configuration ``kvelastic-NAME`` with
those settings to the same run (an A/B in one call: ``--variant si1ms:KVELASTIC_SWITCH_INTERVAL=0.001``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvelastic.units import parse_size
from variants import parse_variant  # beside this file

CONFIGS = ("vanilla", "kvelastic", "offload-arc")
OFFLOAD_BLOCK = 16  # the connector's block size, as in bench_multiturn.py
TICK_WAIT_S = 0.6  # more than two reclaimer ticks (0.25 s): the snapshot counts the last request


def is_kvelastic(config: str) -> bool:
    """``kvelastic`` or one of its ``--variant`` configurations (``kvelastic-NAME``)."""
    return config == "kvelastic" or config.startswith("kvelastic-")


def make_prompts(seed: int, prefix_len: int, suffix_len: int) -> tuple[list[int], list[list[int]]]:
    """One random prefix and three random suffixes (token ids in the range the other scripts use)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 100000) for _ in range(prefix_len)]
    return prefix, [[rng.randrange(1000, 100000) for _ in range(suffix_len)] for _ in range(3)]


def build_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {"model": args.model, "load_format": "dummy", "skip_tokenizer_init": True, "seed": 0,
                          "gpu_memory_utilization": args.gpu_memory_utilization,
                          "max_model_len": args.max_model_len, "enable_prefix_caching": True,
                          "enforce_eager": args.eager, "disable_log_stats": False}
    if args.config == "offload-arc":
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"block_size": OFFLOAD_BLOCK, "cpu_bytes_to_use": args.cpu_bytes,
                                       "eviction_policy": "arc"})
    return LLM(**kw)


def ask(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy request: wall time, vLLM's first-token latency, cached prompt tokens, output."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    ttft = getattr(getattr(out, "metrics", None), "first_token_latency", None)
    return {"wall_ms": wall * 1e3, "ttft_ms": ttft * 1e3 if ttft else None,
            "cached_tokens": getattr(out, "num_cached_tokens", None),
            "tokens": list(out.outputs[0].token_ids)}


def kv_stats() -> dict[str, Any] | None:
    """The latest kvelastic snapshot of this process's engine (None without kvelastic)."""
    try:
        from kvelastic.metrics.metrics import read_snapshots, stats_dir
    except ImportError:
        return None
    found = read_snapshots(stats_dir(), [os.getpid()])
    return found[0]["values"] if found else None


def off_gpu(llm: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Make the next request's prefix a host-tier (kvelastic) or CPU (connector) hit; vanilla only idles
    as long as kvelastic does (its prefix stays on the GPU). With ``--busy-before``, then a short request
    of other tokens ``busy_before`` seconds before the next one."""
    moved: dict[str, Any] = {}
    if args.config == "offload-arc":
        time.sleep(args.settle)
        moved["reset_ok"] = bool(llm.reset_prefix_cache())
    else:
        time.sleep(args.wait)
    if args.busy_before > 0:
        rng = random.Random(seed)
        ask(llm, [rng.randrange(1000, 100000) for _ in range(64)], 1)
        time.sleep(args.busy_before)
    if is_kvelastic(args.config):
        moved["stats"] = kv_stats()
    return moved


def verify(rep: dict[str, Any], args: argparse.Namespace, block: int) -> bool | None:
    """Did both reloads skip recomputing the prefix, and (kvelastic) come from the host tier?"""
    if args.config == "vanilla":
        return None
    need = args.prefix_len // block * block
    cached = all((rep[k]["cached_tokens"] or 0) >= need for k in ("reload", "check"))
    if args.config == "offload-arc":
        return cached and rep["before_reload"]["reset_ok"] and rep["before_check"]["reset_ok"]
    a, b, c = (rep[k]["stats"] for k in ("before_reload", "before_check", "after_check"))
    if not (a and b and c):
        return None
    rep["host_hits"] = [b["host_hits"] - a["host_hits"], c["host_hits"] - b["host_hits"]]
    rep["reloaded_bytes"] = [b["reloaded_bytes"] - a["reloaded_bytes"],
                             c["reloaded_bytes"] - b["reloaded_bytes"]]
    if "load_seconds" in a:  # the copy stream's own time for the reload's copies (its copy clock)
        rep["reload_copy_ms"] = round((b["load_seconds"] - a["load_seconds"]) * 1e3, 1)
    rep["cached_gpu_bytes_before_reload"] = a["cached_bytes"]
    rep["warm_bytes_before_reload"] = a["held_bytes"] - a["mapped_bytes"]  # the reserve the reload could use
    if "pool_lock_wait_seconds" in a:  # the engine's threads waiting for the pool's lock, reload and GPU hit
        rep["pool_lock_wait_ms"] = round((b["pool_lock_wait_seconds"] - a["pool_lock_wait_seconds"]) * 1e3, 1)
    return cached and min(rep["host_hits"]) >= args.prefix_len // block


def run_rep(llm: Any, args: argparse.Namespace, seed: int, block: int) -> dict[str, Any]:
    """Cold, reference, [off GPU], reload, GPU hit, [off GPU], check; see the module docstring."""
    prefix, (s0, s1, s2) = make_prompts(seed, args.prefix_len, args.suffix_len)
    moves = args.config != "vanilla"
    rep: dict[str, Any] = {"seed": seed, "cold": ask(llm, prefix + s0, 1),
                           "reference": ask(llm, prefix + s0, args.check_tokens)}
    rep["before_reload"] = off_gpu(llm, args, seed * 2 + 1)
    # vanilla: the floor of a reload, the same GPU hit after the idle (and busy request) the reloads meet
    rep["reload" if moves else "hit_after_idle"] = ask(llm, prefix + s1, 1)
    rep["gpu_hit"] = ask(llm, prefix + s2, 1)
    if moves:
        rep["before_check"] = off_gpu(llm, args, seed * 2 + 2)
    rep["check"] = ask(llm, prefix + s0, args.check_tokens)
    if is_kvelastic(args.config):
        time.sleep(TICK_WAIT_S)
        rep["after_check"] = {"stats": kv_stats()}
    rep["identical"] = rep["check"]["tokens"] == rep["reference"]["tokens"]
    rep["first_token_as_cold"] = rep["check"]["tokens"][:1] == rep["cold"]["tokens"][:1]
    rep["verified"] = verify(rep, args, block)
    return rep


def host_tier_warning(args: argparse.Namespace, block: int, stats: dict[str, Any] | None) -> str | None:
    """ARC keeps older (re-used) blocks over new ones: past capacity, new prefixes would not stay.

    Judged on the snapshot taken after the run: the engine publishes its first
    one only after its first upkeep tick, so at start-up there is none yet.
    """
    if not is_kvelastic(args.config):
        return None
    if stats is None:
        return "no kvelastic stats snapshot found: is kvelastic active (KVELASTIC=1, installed)?"
    per_rep = (args.prefix_len + 3 * args.suffix_len + args.check_tokens) // block + 3
    if not stats.get("host_hits"):
        return "the host tier served no hit"
    block_bytes = stats["reloaded_bytes"] / stats["host_hits"]  # every hit reloads one block
    holds = int(policy_bytes(stats.get("host_pinned_bytes", 0), block_bytes) // block_bytes)
    if holds < per_rep * (args.reps + args.warmup):
        return (f"the host tier's policy holds {holds} blocks, the run needs about "
                f"{per_rep * (args.reps + args.warmup)}: later reloads may miss; raise --cpu-bytes")
    return None


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import vllm

    t0 = time.perf_counter()
    llm = build_llm(args)
    startup = time.perf_counter() - t0
    config = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
    block = int(getattr(config, "block_size", None) or OFFLOAD_BLOCK)
    result: dict[str, Any] = {"config": args.config, "vllm": vllm.__version__, "block_size": block,
                              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                              "startup_s": startup, "reps": []}
    for i in range(args.warmup + args.reps):
        rep = run_rep(llm, args, args.seed + i, block)
        rep["warmup"] = i < args.warmup
        result["reps"].append(rep)
        times = ", ".join(f"{k} {rep[k]['wall_ms']:.1f} ms" for k in ("cold", "reload", "gpu_hit") if k in rep)
        print(f"{args.config} rep {i}{' (warmup)' if rep['warmup'] else ''}: {times}; "
              f"identical {rep['identical']}, verified {rep['verified']}"
              + (f", pool lock waits {rep['pool_lock_wait_ms']} ms" if "pool_lock_wait_ms" in rep else ""), flush=True)
    result["final_stats"] = kv_stats() if is_kvelastic(args.config) else None
    result["warning"] = host_tier_warning(args, block, result["final_stats"])
    return result


def median(reps: list[dict[str, Any]], key: str, field: str = "wall_ms") -> float | None:
    values = [r[key][field] for r in reps if key in r and r[key][field] is not None]
    return statistics.median(values) if values else None


def summarize(result: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    reps = [r for r in result["reps"] if not r["warmup"]]
    row: dict[str, Any] = {"config": result["config"], "gpu": result["gpu"], "vllm": result["vllm"],
                           "reps": len(reps), "warning": result.get("warning")}
    for key in ("cold", "reload", "gpu_hit", "hit_after_idle"):
        row[f"{key}_ms"] = median(reps, key)
        row[f"{key}_ttft_metric_ms"] = median(reps, key, "ttft_ms")
    copies = [r["reload_copy_ms"] for r in reps if r.get("reload_copy_ms") is not None]
    row["reload_copy_ms"] = statistics.median(copies) if copies else None
    for key in ("reload", "gpu_hit", "hit_after_idle"):  # the spread the median hides
        walls = [r[key]["wall_ms"] for r in reps if key in r and r[key]["wall_ms"] is not None]
        row[f"{key}_range_ms"] = [min(walls), max(walls)] if walls else None
    row["speedup"] = row["cold_ms"] / row["reload_ms"] if row["reload_ms"] else None
    row["identical"] = [sum(r["identical"] for r in reps), len(reps)]
    row["first_token_as_cold"] = [sum(r["first_token_as_cold"] for r in reps), len(reps)]
    row["verified"] = (None if result["config"] == "vanilla"
                       else [sum(bool(r["verified"]) for r in reps), len(reps)])
    if "reloaded_bytes" in (reps[0] if reps else {}):
        row["reloaded_bytes_median"] = statistics.median(r["reloaded_bytes"][0] for r in reps)
        row["host_hits_median"] = statistics.median(r["host_hits"][0] for r in reps)
    if base is not None:  # the same seeds in every configuration: references should agree
        pairs = [(a, b) for a, b in zip(base["reps"], result["reps"]) if not b["warmup"]]
        row["reference_as_vanilla"] = [sum(a["reference"]["tokens"] == b["reference"]["tokens"]
                                           for a, b in pairs), len(pairs)]
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    def frac(x: list[int] | None) -> str:
        return "-" if x is None else f"{x[0]}/{x[1]}"

    print(f"{'config':<12} {'cold TTFT ms':>13} {'reload TTFT ms':>15} {'GPU-hit TTFT ms':>16} "
          f"{'speedup':>8} {'identical':>10} {'1st=cold':>9} {'verified':>9}")
    for r in rows:
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        print(f"{r['config']:<12} {ms(r['cold_ms']):>13} {ms(r['reload_ms']):>15} {ms(r['gpu_hit_ms']):>16} "
              f"{speedup:>8} {frac(r['identical']):>10} {frac(r['first_token_as_cold']):>9} "
              f"{frac(r['verified']):>9}")
        if r.get("reload_copy_ms") is not None:
            print(f"  {r['config']}: the reload's copies on the copy stream, median {r['reload_copy_ms']:.1f} ms")
        for key, what in (("reload", "reload"), ("gpu_hit", "GPU hit (right after the reload)"),
                          ("hit_after_idle", "GPU hit after the reloads' idle (the reload's floor less the copy)")):
            if r.get(f"{key}_range_ms"):
                low, high = r[f"{key}_range_ms"]
                print(f"  {r['config']}: {what} TTFT over {r['reps']} reps {low:.1f}-{high:.1f} ms")
        if r.get("warning"):
            print(f"  warning ({r['config']}): {r['warning']}")


def run_children(args: argparse.Namespace) -> None:
    variants = dict(parse_variant(text) for text in args.variant)
    for config in [*args.configs, *variants]:
        env = dict(os.environ, KVELASTIC="1" if is_kvelastic(config) else "0")
        if is_kvelastic(config):
            env.update(KVELASTIC_CPU_BYTES=str(args.cpu_bytes), KVELASTIC_CACHE_TTL=str(args.ttl))
            env.update(variants.get(config, {}))
        cmd = [sys.executable, __file__, "--config", config, *sys.argv[1:]]
        Path(args.outdir, f"{config}.json").unlink(missing_ok=True)  # never tabulate a stale result
        t0 = time.perf_counter()
        with open(Path(args.outdir, f"{config}.log"), "w") as log:
            code = subprocess.run(cmd, check=False, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        status = f"FAILED (exit {code}), see {args.outdir}/{config}.log" if code else "done"
        print(f"{config}: {status} in {time.perf_counter() - t0:.0f} s", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="scripts/models/llama-8b")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                   help="one more kvelastic config, kvelastic-NAME, with these environment settings")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=5, help="measured prefixes (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="discarded prefixes first (default 1)")
    p.add_argument("--prefix-len", type=int, default=16384)
    p.add_argument("--suffix-len", type=int, default=50)
    p.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared after a reload")
    p.add_argument("--wait", type=float, default=4.0, help="kvelastic: idle seconds for the prefix to spill")
    p.add_argument("--ttl", type=float, default=1.0, help="kvelastic: KVELASTIC_CACHE_TTL seconds")
    p.add_argument("--busy-before", type=float, default=0.0,
                   help="seconds before each reload, a short request of other tokens (0: the engine idles)")
    p.add_argument("--settle", type=float, default=1.0, help="offload-arc: seconds for stores to finish")
    p.add_argument("--cpu-bytes", type=lambda t: parse_size(t, name="--cpu-bytes"), default=None,
                   help="host/CPU tier for kvelastic and the connector, e.g. 16GiB (default: at least 16GiB, "
                        "and room for every rep's prefix with a fifth to spare)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=20480)
    p.add_argument("--eager", action="store_true", help="enforce_eager: faster start-up, no CUDA graphs")
    p.add_argument("--seed", type=int, default=1000, help="prefix i uses seed+i")
    p.add_argument("--outdir", default="reload")
    p.add_argument("--json", default="reload.json")
    p.add_argument("--collect-only", action="store_true", help="tabulate <outdir>/*.json from earlier runs")
    args = p.parse_args()
    if args.prefix_len + args.suffix_len + args.check_tokens > args.max_model_len:
        p.error("--prefix-len + --suffix-len + --check-tokens must fit --max-model-len")
    if args.cpu_bytes is None:
        args.cpu_bytes = default_cpu_bytes(args)
    return args


def default_cpu_bytes(args: argparse.Namespace) -> int:
    """16 GiB, or more where the reps' prefixes need it: the policy must never evict an earlier rep's prefix
    before its reload (nine 16k-token 8B reps missed once in 16 GiB). Sized from the model's
    ``config.json`` (K and V per layer, bf16) with a fifth to spare for the suffixes and the policy's ghosts,
    in the part of the tier that write-through (the default) leaves to the policy: eight reps missed once
    in 20 GiB, ARC's capacity being 15 GiB of it."""
    config = json.loads(Path(args.model, "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    token_bytes = 2 * config["num_hidden_layers"] * kv_heads * head_dim * 2
    tokens = (args.prefix_len + 3 * args.suffix_len + args.check_tokens) * (args.reps + args.warmup)
    need, gib = tokens * token_bytes * 6 // 5, 16
    while policy_bytes(gib << 30, token_bytes * 16) < need:  # a block of 16 tokens per slot
        gib += 1
    return gib << 30


def policy_bytes(tier_bytes: int, block_bytes: int) -> int:
    """What of a host tier of ``tier_bytes`` its policy manages with the default write-through, whose share
    for copies made ahead (:func:`kvelastic.offload.write_through.ahead_slots`) it does not."""
    from kvelastic.offload.write_through import ahead_slots

    slots = int(tier_bytes // block_bytes)
    return (slots - ahead_slots(slots)) * int(block_bytes)


def main() -> int:
    args = parse_args()
    if args.config:
        Path(args.outdir, f"{args.config}.json").write_text(json.dumps(run_one(args)))
        return 0
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    if not args.collect_only:
        run_children(args)
    if args.collect_only:  # every configuration's file the outdir holds (variants included)
        order = {c: i for i, c in enumerate(CONFIGS)}  # the usual configurations first, then variants
        files = sorted((f for f in Path(args.outdir).glob("*.json") if f.stem in CONFIGS or is_kvelastic(f.stem)),
                       key=lambda f: (order.get(f.stem, len(CONFIGS)), f.stem))
    else:
        files = [Path(args.outdir, f"{c}.json") for c in [*args.configs, *dict(map(parse_variant, args.variant))]]
    results = {f.stem: json.loads(f.read_text()) for f in files if f.exists()}
    base = results.get("vanilla")
    rows = [summarize(r, base if r is not base else None) for r in results.values()]
    print_table(rows)
    Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "config"},
                                           "rows": rows}, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
