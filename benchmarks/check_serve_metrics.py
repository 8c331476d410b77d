"""kvelastic_* on ``/metrics`` of ``vllm serve --api-server-count N`` (multiprocess metrics).

With several API-server processes vLLM serves ``/metrics`` from a multiprocess
registry, not the default one where kvelastic's collector lives. This starts one
dummy-weight server with KVELASTIC=1, a small limit and a host tier (so spills
and reloads move the counters), sends prompts that share prefixes twice, then
scrapes ``/metrics`` several times: the API servers take turns, so each scrape
may come from a different process. Every scrape must show vLLM's own ``vllm:``
metrics and kvelastic's gauges for the engine. Writes serve_metrics.json and
server.log under --outdir. Exit 0: all checks passed; 1: one failed; 2: no server.

    python3 benchmarks/check_serve_metrics.py --outdir "$OUT/serve"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from demo_support import complete, healthy, http, parse_metrics, prompt, run_all

WATCHED = ("kvelastic_mapped_bytes", "kvelastic_host_used_bytes", "kvelastic_spilled_bytes_total",
           "kvelastic_reloaded_bytes_total", "kvelastic_host_hits_total", "kvelastic_host_arc_target_blocks")
MODEL_NAME = re.compile(r'^kvelastic_\w+\{[^}]*model_name="([^"]*)"')


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--outdir", default=os.environ.get("OUT") or "serve-out")
    add("--model", default=str(HERE / "models" / "llama-1b"))
    add("--port", type=int, default=8011)
    add("--api-servers", type=int, default=2)
    add("--env", nargs="*", default=["KVELASTIC_LIMIT=256MiB", "KVELASTIC_CPU_BYTES=4GiB",
                                     "KVELASTIC_CACHE_TTL=2"])
    add("--prompts", type=int, default=32)
    add("--scrapes", type=int, default=6)
    add("--ready-timeout", type=float, default=420.0)
    return p.parse_args(argv)


def start_server(ns: argparse.Namespace, log: Path) -> subprocess.Popen:
    env = dict(os.environ, KVELASTIC="1", **dict(pair.split("=", 1) for pair in ns.env))
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", ns.model, "--load-format", "dummy",
           "--max-model-len", "4096", "--gpu-memory-utilization", "0.3", "--enforce-eager",
           "--port", str(ns.port), "--api-server-count", str(ns.api_servers), "--served-model-name", "m"]
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def send_round(url: str, count: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in range(count)]

    def one(i: int) -> None:
        try:
            results[i] = complete(url, "m", prompt(i), 16)
        except Exception as error:  # noqa: BLE001 - recorded, judged by the checks
            results[i] = {"error": repr(error)}

    run_all([threading.Thread(target=one, args=(i,)) for i in range(count)])
    return results


def scrape(url: str) -> dict[str, Any]:
    text = http(url + "/metrics", timeout=10).decode()
    samples = [line for line in text.splitlines() if line.startswith("kvelastic_")]
    return {"vllm_lines": sum(line.startswith("vllm:") for line in text.splitlines()),
            "kvelastic": {name: values for name, values in parse_metrics(text).items() if name in WATCHED},
            "model_names": sorted({m.group(1) if (m := MODEL_NAME.match(line)) else "" for line in samples})}


def _largest(scrape: dict[str, Any], name: str) -> float:
    """A metric's largest value over its engines in one scrape; 0 where the scrape lacks it."""
    return max((scrape["kvelastic"].get(name) or {"": 0.0}).values())


def run_checks(ns: argparse.Namespace, url: str, data: dict[str, Any]) -> list[tuple[str, bool]]:
    first = send_round(url, ns.prompts)
    time.sleep(4)  # TTL 2 s: the idle cache is spilled and released by the reclaimer
    second = send_round(url, ns.prompts)
    data["errors"] = [r["error"] for r in first + second if "error" in r]
    data["identical"] = sum(a.get("key") == b.get("key") for a, b in zip(first, second))
    data["cached_tokens_second"] = [r.get("cached_tokens") for r in second]
    data["scrapes"] = [scrape(url) for _ in range(ns.scrapes)]
    scrapes = data["scrapes"]
    spilled = [_largest(s, "kvelastic_spilled_bytes_total") for s in scrapes]
    return [
        ("no request failed", not data["errors"]),
        ("second round token-identical to the first", data["identical"] == ns.prompts),
        ("every scrape has vllm: metrics", all(s["vllm_lines"] > 0 for s in scrapes)),
        ("every scrape has kvelastic_mapped_bytes > 0",
         all(_largest(s, "kvelastic_mapped_bytes") > 0 for s in scrapes)),
        ("every scrape has the host-tier counters", all("kvelastic_host_hits_total" in s["kvelastic"]
                                                         for s in scrapes)),
        ("spills counted (limit + idle TTL forced them)", max(spilled) > 0),
        ("every kvelastic_ sample carries vLLM's model_name", all(s["model_names"] == ["m"] for s in scrapes)),
    ]


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    outdir = Path(ns.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    url, data = f"http://127.0.0.1:{ns.port}", {"args": vars(ns)}
    server = start_server(ns, outdir / "server.log")
    try:
        deadline = time.monotonic() + ns.ready_timeout
        while not healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"server not ready (rc={server.poll()}); see {outdir / 'server.log'}")
                return 2
            time.sleep(2)
        data["ready_s"] = ns.ready_timeout - (deadline - time.monotonic())
        checks = run_checks(ns, url, data)
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
    data["checks"] = {name: ok for name, ok in checks}
    (outdir / "serve_metrics.json").write_text(json.dumps(data, indent=1))
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for i, s in enumerate(data["scrapes"]):
        print(f"scrape {i}: vllm lines {s['vllm_lines']}, " + ", ".join(
            f"{k.removeprefix('kvelastic_')}={v}" for k, v in sorted(s["kvelastic"].items())))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
