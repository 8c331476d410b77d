"""A TP=2 engine and a one-GPU engine sharing GPU 0's shared account: sharing under parallelism.

Starts two ``vllm serve`` processes with ``KVELASTIC=1``: ``tp`` (the 8B config, TP=2 over GPUs 0
and 1) and ``small`` (the 1B model on GPU 0 only), with one shared budget per GPU
(``KVELASTIC_SHARED_BUDGET``) smaller than both would take alone. Then three phases of load:
``tp`` alone, ``small`` alone, both. ``kvelastic status --json`` is sampled every half second.
Checks:

* ``tp`` is a member of both GPUs' accounts, ``small`` of GPU 0's only;
* on every sample, the members of each account hold no more than its budget together;
* the idle engine gives memory back to the busy one: while ``small`` runs alone it maps more
  than half of GPU 0's budget (a static split would give it half), and so does ``tp`` alone;
* no request fails.

Writes tp_sharing.json and the servers' logs under --outdir; prints the checks.
Exit 0: all passed; 1: one failed; 2: a server did not start.

    python3 benchmarks/check_tp_sharing.py --outdir "$OUT/tp-sharing"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from check_data_parallel import Sampler, model_folder, one_pass, stop_server  # noqa: E402
from demo_support import healthy, run_all  # noqa: E402

GIB = 1 << 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--outdir", default=os.environ.get("OUT") or "tp-sharing-out")
    add("--model", default=str(HERE / "models" / "llama-8b"), help="the TP engine's config.json folder")
    add("--tokenizer-from", default=str(HERE.parent / "kvelastic" / "models" / "llama-1b"))
    add("--small-model", default=str(HERE.parent / "kvelastic" / "models" / "llama-1b"))
    add("--budget", default="4GiB", help="KVELASTIC_SHARED_BUDGET: each GPU's shared KV budget (below what "
        "either engine would take alone under this load)")
    add("--ports", type=int, nargs=2, default=[8031, 8032])
    add("--prompts", type=int, default=96)
    add("--max-tokens", type=int, default=64)
    add("--ready-timeout", type=float, default=480.0)
    return p.parse_args(argv)


def start(name: str, model: Path, port: int, extra: list[str], env: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--load-format", "dummy",
           "--max-model-len", "4096", "--gpu-memory-utilization", "0.4", "--port", str(port),
           "--served-model-name", "m", *extra]
    env = dict(os.environ, KVELASTIC="1", KVELASTIC_NAME=name, KVELASTIC_CACHE_TTL="2", **env)
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def held(sample: dict, name: str, gpu: str | None = None) -> int:
    """Bytes ``name`` holds in ``gpu``'s account (or its most in any account) in one sample."""
    values = [m["mapped_bytes"] for a in sample["accounts"] if gpu is None or a["gpu"] == gpu
              for m in a["members"] if m["name"] == name]
    return max(values, default=0)


def judge(data: dict, budget: int) -> list[tuple[str, bool, str]]:
    samples, phases = data["samples"], data["phases"]
    member_of = {a["gpu"]: sorted({m["name"] for m in a["members"]}) for s in samples for a in s["accounts"]}
    shared = [gpu for gpu, names in member_of.items() if names == ["small", "tp"]]
    first = min(start for start, _ in phases.values())  # start-up warm-up is counted, never refused
    over = [(s["t"], a["gpu"], a["mapped_bytes"]) for s in samples if s["t"] >= first for a in s["accounts"]
            if a["mapped_bytes"] > budget]

    def most(name: str, phase: str) -> int:
        start, end = phases[phase]
        return max((held(s, name, shared[0] if shared else None) for s in samples if start <= s["t"] <= end),
                   default=0)

    errors = [r["error"] for r in data["results"] if "error" in r]
    tp_alone, small_alone = most("tp", "tp alone"), most("small", "small alone")
    return [
        ("no request failed", not errors, f"{len(errors)} errors"),
        ("tp in two accounts, small in one, one account shared", len(shared) == 1
         and sum("tp" in n for n in member_of.values()) == 2 and sum("small" in n for n in member_of.values()) == 1,
         json.dumps(member_of)),
        ("every account within its budget on every sample", not over, f"{len(over)} samples over"),
        ("small alone maps more than half the shared GPU's budget", small_alone > budget // 2,
         f"{small_alone / GIB:.2f} of {budget / GIB:.2f} GiB"),
        ("tp alone maps more than half the shared GPU's budget", tp_alone > budget // 2,
         f"{tp_alone / GIB:.2f} of {budget / GIB:.2f} GiB"),
    ]


def run_phases(ns: argparse.Namespace, urls: dict[str, str], sampler: Sampler) -> dict:
    """Idle, then ``tp`` alone, ``small`` alone, both at once, each followed by an idle pause."""
    phases, results = {}, []
    time.sleep(8)  # both idle past the cache TTL: what start-up mapped is given back first
    for label, names in (("tp alone", ["tp"]), ("small alone", ["small"]), ("both", ["tp", "small"])):
        start = sampler.now()
        done: list[list[dict]] = []
        threads = [threading.Thread(target=lambda n=n: done.append(one_pass(urls[n], ns.prompts, ns.max_tokens,
                                                                             1000 * len(phases))[0]))
                   for n in names]
        run_all(threads)
        phases[label] = (start, sampler.now())
        results += [r for batch in done for r in batch]
        time.sleep(6)
    return {"phases": phases, "results": results}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from kvelastic.units import parse_size  # installed where the servers run

    outdir = Path(ns.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    budget = parse_size(ns.budget)
    shared = {"KVELASTIC_SHARED_BUDGET": ns.budget}
    servers = {
        "tp": start("tp", model_folder(ns, outdir), ns.ports[0], ["--tensor-parallel-size", "2"], shared,
                    outdir / "server-tp.log"),
        "small": start("small", Path(ns.small_model), ns.ports[1], ["--enforce-eager"],
                       {**shared, "CUDA_VISIBLE_DEVICES": "0"}, outdir / "server-small.log"),
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in zip(servers, ns.ports)}
    sampler = None
    try:
        deadline = time.monotonic() + ns.ready_timeout
        while not all(healthy(u) for u in urls.values()):
            if any(s.poll() is not None for s in servers.values()) or time.monotonic() > deadline:
                print("a server did not start: see server-*.log")
                return 2
            time.sleep(2)
        sampler = Sampler(with_status=True)
        data = run_phases(ns, urls, sampler)
    finally:
        samples = sampler.stop() if sampler is not None else []
        for server in servers.values():
            stop_server(server)
    data.update(samples=samples, budget=budget, args=vars(ns))
    checks = judge(data, budget)
    data["checks"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks]
    (outdir / "tp_sharing.json").write_text(json.dumps(data, indent=1))
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
