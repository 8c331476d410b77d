"""``vllm serve --data-parallel-size 2`` with kvelastic against vanilla: data parallelism.

vLLM starts one engine core per DP rank, each in its own process with its own GPU
(``CUDA_VISIBLE_DEVICES`` set per rank), behind one API server. Each engine core
is then a one-GPU engine to kvelastic: its own pool, and a member of its own GPU's
shared account. This serves the same dummy-weight model twice, vanilla and with
``KVELASTIC=1``, sends the same prompts (two passes: cold, then warm) and checks:

* every completion token-identical to vanilla's (greedy, ``ignore_eos``);
* both GPUs' memory rising under load and falling once idle (nvidia-smi);
* ``kvelastic status --json``: one account per GPU, each with a live member of
  this server, and both members mapped KV memory at some point (both ranks served).

Writes dp.json, the servers' logs and the samples under --outdir; prints a table.
Exit 0: all checks passed; 1: one failed; 2: a server did not start.

    python3 benchmarks/check_data_parallel.py --outdir "$OUT/dp"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from demo_support import complete, healthy, prompt, run_all

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
GIB = 1 << 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--outdir", default=os.environ.get("OUT") or "dp-out")
    add("--model", default=str(HERE / "models" / "llama-8b"), help="a config.json folder (dummy weights)")
    add("--tokenizer-from", default=str(HERE.parent / "kvelastic" / "models" / "llama-1b"),
        help="a folder whose tokenizer files serve the model (Llama 3 vocabulary)")
    add("--port", type=int, default=8021)
    add("--dp", type=int, default=2)
    add("--prompts", type=int, default=128)
    add("--max-tokens", type=int, default=64)
    add("--idle-after", type=float, default=8.0, help="seconds idle before the last memory reading")
    add("--kve-env", nargs="*", default=["KVELASTIC_CACHE_TTL=2"])
    add("--ready-timeout", type=float, default=480.0)
    return p.parse_args(argv)


def model_folder(ns: argparse.Namespace, outdir: Path) -> Path:
    """The model's config beside a tokenizer: ``vllm serve`` needs one, the 8B config has none."""
    folder = outdir / "model"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(ns.model) / "config.json", folder / "config.json")
    for name in TOKENIZER_FILES:
        if (Path(ns.tokenizer_from) / name).exists():
            shutil.copy(Path(ns.tokenizer_from) / name, folder / name)
    return folder


def gpu_memory() -> list[int]:
    """Used bytes per GPU, as nvidia-smi counts them (every process, every allocation)."""
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=15, check=False)
    return [int(line) << 20 for line in done.stdout.split()]


def kvelastic_status() -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "kvelastic.cli", "status", "--json"],
                          capture_output=True, text=True, timeout=15, check=False)
    text = done.stdout.strip()
    return json.loads(text).get("accounts", []) if text.startswith("{") else []


class Sampler:
    """nvidia-smi (and, for kvelastic, ``status --json``) every half second, in a thread."""

    def __init__(self, with_status: bool) -> None:
        self.with_status, self.samples, self.t0 = with_status, [], time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sample = {"t": self.now(), "gpu": gpu_memory()}
                if self.with_status:
                    sample["accounts"] = kvelastic_status()
                self.samples.append(sample)
            except Exception:  # noqa: BLE001 - a missed sample, never a dead sampler
                pass
            self._stop.wait(0.5)

    def now(self) -> float:
        """Seconds since sampling began, as the samples' ``t``."""
        return round(time.monotonic() - self.t0, 2)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=20)
        return self.samples


def start_server(ns: argparse.Namespace, model: Path, env_pairs: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, **dict(pair.split("=", 1) for pair in env_pairs))
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--load-format", "dummy",
           "--max-model-len", "4096", "--gpu-memory-utilization", "0.5", "--port", str(ns.port),
           "--data-parallel-size", str(ns.dp), "--served-model-name", "m"]
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_server(server: subprocess.Popen) -> None:
    try:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, 9)
    except ProcessLookupError:
        pass


def one_pass(url: str, count: int, max_tokens: int, first: int = 0) -> tuple[list[dict], float]:
    """Prompts ``first`` .. ``first + count - 1`` at once; their results and the seconds they took."""
    results: list[dict] = [{} for _ in range(count)]

    def one(i: int) -> None:
        try:
            results[i] = complete(url, "m", prompt(first + i), max_tokens)
        except Exception as error:  # noqa: BLE001 - recorded, judged by the checks
            results[i] = {"error": repr(error)}

    began = time.monotonic()
    run_all([threading.Thread(target=one, args=(i,)) for i in range(count)])
    return results, time.monotonic() - began


def serve_and_load(ns: argparse.Namespace, model: Path, label: str, env_pairs: list[str], outdir: Path) -> dict:
    """Start a server, wait for it, two passes of the prompts, idle, stop: what was seen."""
    url, run = f"http://127.0.0.1:{ns.port}", {"label": label, "env": env_pairs}
    server = start_server(ns, model, env_pairs, outdir / f"server-{label}.log")
    sampler: Sampler | None = None
    try:
        deadline = time.monotonic() + ns.ready_timeout
        began = time.monotonic()
        while not healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                run["failed"] = f"not ready (rc={server.poll()}); see server-{label}.log"
                return run
            time.sleep(2)
        run["ready_s"] = round(time.monotonic() - began, 1)
        sampler = Sampler(with_status=label != "vanilla")
        time.sleep(1.5)
        run["marks"] = {"load": round(time.monotonic() - sampler.t0, 2)}
        run["passes"] = []
        for _ in range(2):
            results, seconds = one_pass(url, ns.prompts, ns.max_tokens)
            run["passes"].append({"seconds": round(seconds, 3), "results": results})
        run["marks"]["idle"] = round(time.monotonic() - sampler.t0, 2)
        time.sleep(ns.idle_after)
    finally:
        if sampler is not None:
            run["samples"] = sampler.stop()
        stop_server(server)
    return run


def memory_phases(run: dict) -> list[dict]:
    """Per GPU: used bytes when the load began, at its peak, and after the idle time."""
    samples, marks = run.get("samples") or [], run.get("marks") or {}
    if not samples or "load" not in marks:
        return []
    before = [s for s in samples if s["t"] <= marks["load"]] or samples[:1]
    return [{"gpu": g, "start": before[-1]["gpu"][g], "peak": max(s["gpu"][g] for s in samples),
             "end": samples[-1]["gpu"][g]} for g in range(len(samples[0]["gpu"]))]


def accounts_serving(run: dict) -> dict[str, int]:
    """GPU account -> the most KV bytes its members mapped in any sample (accounts with a member only)."""
    seen: dict[str, int] = {}
    for sample in run.get("samples") or []:
        for account in sample.get("accounts", []):
            if account.get("members"):
                seen[account["gpu"]] = max(seen.get(account["gpu"], 0), int(account["mapped_bytes"]))
    return seen


def judge(ns: argparse.Namespace, vanilla: dict, elastic: dict) -> list[tuple[str, bool, str]]:
    keys = lambda run: [r.get("key") for p in run.get("passes", []) for r in p["results"]]  # noqa: E731
    errors = [r["error"] for run in (vanilla, elastic) for p in run.get("passes", []) for r in p["results"]
              if "error" in r]
    same = sum(a is not None and a == b for a, b in zip(keys(vanilla), keys(elastic)))
    phases = memory_phases(elastic)
    rose = all(p["peak"] - p["start"] >= GIB for p in phases)
    fell = all(p["peak"] - p["end"] >= GIB for p in phases)
    serving = accounts_serving(elastic)
    return [
        ("no request failed", not errors, f"{len(errors)} errors"),
        ("outputs token-identical to vanilla DP", same == 2 * ns.prompts, f"{same}/{2 * ns.prompts}"),
        (f"all {ns.dp} GPUs' memory rose by 1 GiB+ under load", len(phases) >= ns.dp and rose,
         ", ".join(f"GPU{p['gpu']} {p['start'] / GIB:.1f}->{p['peak'] / GIB:.1f}" for p in phases)),
        ("and fell by 1 GiB+ once idle", len(phases) >= ns.dp and fell,
         ", ".join(f"GPU{p['gpu']} ->{p['end'] / GIB:.1f}" for p in phases)),
        (f"{ns.dp} GPU accounts, each with a member that mapped KV memory",
         sum(b > 0 for b in serving.values()) >= ns.dp,
         ", ".join(f"{gpu[:16]}: {b / GIB:.1f} GiB" for gpu, b in serving.items()) or "no account"),
    ]


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    outdir = Path(ns.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    model = model_folder(ns, outdir)
    vanilla = serve_and_load(ns, model, "vanilla", ["KVELASTIC=0"], outdir)
    elastic = serve_and_load(ns, model, "kvelastic", ["KVELASTIC=1", *ns.kve_env], outdir)
    data = {"args": vars(ns), "runs": [vanilla, elastic]}
    failed = [r["failed"] for r in (vanilla, elastic) if "failed" in r]
    checks = [] if failed else judge(ns, vanilla, elastic)
    data["checks"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks]
    (outdir / "dp.json").write_text(json.dumps(data, indent=1))
    for run in (vanilla, elastic):
        seconds = " / ".join(f"{p['seconds']:.2f}" for p in run.get("passes", []))
        print(f"{run['label']:10s} ready {run.get('ready_s', '-')} s, passes (cold / warm) {seconds} s "
              f"{run.get('failed', '')}")
    if not failed:
        cold, warm = (vanilla["passes"][i]["seconds"] / elastic["passes"][i]["seconds"] for i in range(2))
        print(f"kvelastic / vanilla throughput: cold {cold:.3f}x, warm {warm:.3f}x")
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    if failed:
        return 2
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
