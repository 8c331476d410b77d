"""An RL-style loop with vLLM's sleep mode, vanilla against kvelastic: generate, sleep, wake, generate.

For each level, each configuration runs in a process of its own: an engine with
``enable_sleep_mode=True`` on dummy weights generates, sleeps (level 1, or level 2 then
``wake_up(["weights"])``, ``reload_weights`` and ``wake_up(["kv_cache"])`` as RL
frameworks do), wakes and generates the same prompts again. Greedy outputs must be the
same before and after sleep and the same as vanilla's; the GPU's used memory is read at
each point (nvidia-smi, the whole GPU: run it alone there).

    python benchmarks/check_sleep.py --model scripts/models/llama-1b --outdir OUT [--levels 1 2]

Prints a table and writes ``OUT/sleep.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GIB = 1 << 30


def used_gib() -> float:
    time.sleep(1.0)  # unmaps and frees settle; nvidia-smi reads the driver
    text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True, timeout=30).stdout
    return int(text.split()[0]) / 1024


def one_run(args: argparse.Namespace) -> dict:
    """This process: the loop once, at ``args.level``."""
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm_run import make_prompts

    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0, enable_sleep_mode=True,
              gpu_memory_utilization=args.gpu_util, max_model_len=4096, enable_prefix_caching=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(1234, args.prompts, 50, 1500, 700)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    memory = {"ready": used_gib()}
    before = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    memory["loaded"] = used_gib()
    t = time.perf_counter()
    llm.sleep(level=args.level)
    sleep_s = time.perf_counter() - t
    memory["asleep"] = used_gib()
    t = time.perf_counter()
    if args.level == 2:
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")  # dummy weights: the same values again, from the seed
        llm.wake_up(tags=["kv_cache"])
    else:
        llm.wake_up()
    wake_s = time.perf_counter() - t
    memory["awake"] = used_gib()
    t = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first_s = time.perf_counter() - t
    after = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    memory["after"] = used_gib()
    return {"kvelastic": os.environ.get("KVELASTIC", "0"), "level": args.level, "memory_gib": memory,
            "sleep_s": sleep_s, "wake_s": wake_s, "first_request_after_wake_s": first_s,
            "before": before, "after": after}


def run_child(args: argparse.Namespace, level: int, kvelastic: bool, outdir: Path) -> dict | None:
    name = f"sleep-l{level}-{'kve' if kvelastic else 'vanilla'}"
    out = outdir / f"{name}.json"
    env = {**os.environ, "KVELASTIC": "1" if kvelastic else "0", "KVELASTIC_CACHE_TTL": "2"}
    command = [sys.executable, __file__, "--model", args.model, "--run", str(out), "--level", str(level),
               "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens), "--gpu-util", str(args.gpu_util)]
    with open(outdir / f"{name}.log", "w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    return json.loads(out.read_text()) if code == 0 and out.exists() else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--outdir", default="sleep-out")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gpu-util", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--run", help=argparse.SUPPRESS)  # a child: one loop, its JSON here
    p.add_argument("--level", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        Path(args.run).write_text(json.dumps(one_run(args)))
        return 0
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    rows, ok = [], True
    print(f"{'config':16} {'kept':>7} {'=vanilla':>9} {'GiB ready/loaded/asleep/awake/after':>38} "
          f"{'sleep s':>8} {'wake s':>7} {'1st req s':>9}")
    for level in args.levels:
        vanilla = run_child(args, level, False, outdir)
        elastic = run_child(args, level, True, outdir)
        for name, run in (("vanilla", vanilla), ("kvelastic", elastic)):
            if run is None:
                print(f"{name}-l{level}: the run failed (its log is in {outdir})")
                ok = False
                continue
            kept = sum(a == b for a, b in zip(run["before"], run["after"]))
            same = sum(a == b for a, b in zip(run["after"], vanilla["after"])) if vanilla else 0
            ok &= kept == len(run["before"]) and (vanilla is None or same == len(run["after"]))
            m = run["memory_gib"]
            print(f"{name + '-l' + str(level):16} {kept:>3}/{len(run['before']):<3} {same:>4}/{len(run['after']):<4} "
                  f"{'/'.join(f'{m[k]:.2f}' for k in ('ready', 'loaded', 'asleep', 'awake', 'after')):>38} "
                  f"{run['sleep_s']:>8.2f} {run['wake_s']:>7.2f} {run['first_request_after_wake_s']:>9.3f}")
            rows.append({k: v for k, v in run.items() if k not in ("before", "after")}
                        | {"config": name, "identical_before_after": kept, "identical_to_vanilla": same})
    (outdir / "sleep.json").write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
