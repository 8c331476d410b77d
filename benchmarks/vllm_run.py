"""One vLLM engine run on dummy weights: greedy outputs, timings and GPU memory over time.

Run it twice, with and without ``KVELASTIC=1``, and compare the JSON files:
``benchmarks/e2e_check.py`` does exactly that for a matrix of configurations.

    python benchmarks/vllm_run.py --model scripts/models/llama-1b --out run.json [--v1] [--offload]

``--connector MODE`` runs one of vLLM's own offload connectors (SimpleCPUOffloadConnector
eager or lazy, OffloadingConnector lru or arc) or LMCache's in-process connector with the
engine core in this process, and counts the prompt tokens it serves and (vLLM's connectors)
the GPU blocks it stores and loads from its own scheduler-side metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

MIB = 1024 * 1024
CONNECTORS = {  # mode: (connector, extra config besides cpu_bytes_to_use)
    "simple-eager": ("SimpleCPUOffloadConnector", {}),
    "simple-lazy": ("SimpleCPUOffloadConnector", {"lazy_offload": True}),
    "offload-lru": ("OffloadingConnector", {"block_size": 16, "eviction_policy": "lru"}),
    "offload-arc": ("OffloadingConnector", {"block_size": 16, "eviction_policy": "arc"}),
    # LMCache's in-process connector, its CPU store sized from --cpu-bytes (LMCACHE_* variables, set below)
    "lmcache": ("LMCacheConnectorV1", {}),
}


class GpuMemorySampler:
    """Samples the GPU's used memory (all processes) with nvidia-smi, every ``period`` seconds."""

    def __init__(self, period: float = 0.2):
        self.period = period
        self.samples: list[tuple[float, int]] = []
        self.per_gpu: list[tuple[float, list[int]]] = []
        self.marks: list[tuple[float, str]] = []
        self.stalls = 0  # nvidia-smi calls that took over 5 s
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> list[int] | None:
        """Used bytes per GPU; None when nvidia-smi takes over 5 s (it waits on the driver, which
        another process's teardown can hold: a sampler stuck there kept a finished run from exiting)."""
        try:
            text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, check=True, timeout=5).stdout
        except subprocess.TimeoutExpired:
            self.stalls += 1
            return None
        return [int(v) * MIB for v in text.split()]

    def _run(self) -> None:
        while not self._stop.is_set():
            per_gpu = self._read()
            if per_gpu is None:
                continue
            now = time.monotonic() - self._t0
            self.samples.append((now, per_gpu[0]))  # the first GPU: every run uses it
            self.per_gpu.append((now, per_gpu))
            self._stop.wait(self.period)

    def mark(self, label: str) -> None:
        self.marks.append((time.monotonic() - self._t0, label))

    def __enter__(self) -> "GpuMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def make_prompts(seed: int, count: int, min_len: int, max_len: int, shared_prefix: int) -> list[list[int]]:
    """Random token ids; a quarter of them share one prefix, so prefix caching has hits."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 100000) for _ in range(shared_prefix)]
    prompts = []
    for i in range(count):
        body = [rng.randrange(1000, 100000) for _ in range(rng.randint(min_len, max_len))]
        prompts.append(prefix + body if i % 4 == 0 and shared_prefix else body)
    return prompts


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--v1", action="store_true", help="force the V1 model runner")
    p.add_argument("--offload", action="store_true", help="vLLM OffloadingConnector (4 GiB CPU)")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    p.add_argument("--mp", action="store_true", help="multiprocess executor even at TP=1 (worker in a child)")
    p.add_argument("--executor", choices=("mp", "ray"), default="mp",
                   help="the executor of a run with several workers: vLLM's multiprocess one or Ray's")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--min-len", type=int, default=50)
    p.add_argument("--max-len", type=int, default=1500)
    p.add_argument("--shared-prefix", type=int, default=700)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--passes", type=int, default=2, help="generate the same prompts this many times")
    p.add_argument("--gpu-util", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--idle-after", type=float, default=0.0, help="seconds to keep sampling memory at the end")
    p.add_argument("--kv-bytes", type=str, default=None, help="--kv-cache-memory-bytes for vLLM")
    p.add_argument("--vanilla-kv-bytes", type=int, default=None,
                   help="--kv-cache-memory-bytes for a run without kvelastic only (kvelastic: KVELASTIC_LIMIT)")
    p.add_argument("--connector", choices=sorted(CONNECTORS), default=None, help="one of vLLM's offload connectors, or LMCache's")
    p.add_argument("--cpu-bytes", type=int, default=4 << 30, help="the connector's cpu_bytes_to_use")
    p.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="one more argument for vLLM's LLM(), VALUE read as JSON where it parses "
                        "(kv_cache_dtype=fp8, speculative_config='{\"method\": \"ngram\", ...}')")
    return p.parse_args()


def build_llm(args: argparse.Namespace):
    from vllm import LLM

    kwargs = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0,
                  gpu_memory_utilization=args.gpu_util, max_model_len=args.max_model_len,
                  enable_prefix_caching=True, enforce_eager=args.eager, disable_log_stats=False)
    if args.kv_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_bytes
    if args.vanilla_kv_bytes and os.environ.get("KVELASTIC", "0") != "1":
        kwargs["kv_cache_memory_bytes"] = args.vanilla_kv_bytes
    if args.tp > 1:
        kwargs["tensor_parallel_size"] = args.tp
    if args.pp > 1:
        kwargs["pipeline_parallel_size"] = args.pp
    if args.mp or args.tp > 1 or args.pp > 1:
        kwargs["distributed_executor_backend"] = args.executor
    if args.offload:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"block_size": 64, "cpu_bytes_to_use": 4 << 30})
    if args.connector:
        from vllm.config import KVTransferConfig

        name, extra = CONNECTORS[args.connector]
        if name == "LMCacheConnectorV1":  # LMCache reads its configuration from the environment
            os.environ.update(LMCACHE_CHUNK_SIZE="256", LMCACHE_LOCAL_CPU="True",
                              LMCACHE_MAX_LOCAL_CPU_SIZE=str(args.cpu_bytes / 2**30))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name, kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": args.cpu_bytes,
                                                                              **extra})
    kwargs.update(engine_args(args.engine_arg))
    return LLM(**kwargs)


def engine_args(pairs: list[str]) -> dict:
    """``NAME=VALUE`` pairs as LLM() keyword arguments; a VALUE that is not JSON stays a string."""
    parsed = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--engine-arg wants NAME=VALUE, got {pair!r}")
        try:
            parsed[name] = json.loads(text)
        except json.JSONDecodeError:
            parsed[name] = text
    return parsed


def count_connector_transfers(llm) -> dict:
    """The prompt tokens the connector serves (vLLM's ``update_state_after_alloc``) and, for vLLM's offload
    connectors, the GPU blocks it asks its workers to store and load, read off its own metadata each step.

    Needs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    """
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvelastic_dev.connector_transfers import transfers_of

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    counts = {"connector": type(connector).__name__, "external_tokens": 0, "requests_with_external_tokens": 0}
    after_alloc = connector.update_state_after_alloc

    def counting_hits(request, blocks, num_external_tokens):  # vLLM's call once a request's blocks are allocated
        counts["external_tokens"] += num_external_tokens
        counts["requests_with_external_tokens"] += num_external_tokens > 0
        return after_alloc(request, blocks, num_external_tokens)

    connector.update_state_after_alloc = counting_hits
    if counts["connector"] == "LMCacheConnectorV1":  # its metadata is its own: the hits above are its count
        return counts
    counts.update(stored_blocks=0, loaded_blocks=0, steps_with_loads=0)
    build = connector.build_connector_meta

    def counting(scheduler_output):
        meta = build(scheduler_output)
        transfers = transfers_of(meta)
        counts["stored_blocks"] += sum(len(t.gpu_blocks) for t in transfers if t.kind == "store")
        loaded = sum(len(t.gpu_blocks) for t in transfers if t.kind == "load")
        counts["loaded_blocks"] += loaded
        counts["steps_with_loads"] += loaded > 0
        return meta

    connector.build_connector_meta = counting
    return counts


def _descends_from(pid: int, ancestor: int) -> bool:
    """``pid`` is ``ancestor`` or one of its descendants (False once the process is gone)."""
    import psutil  # a dependency of vLLM

    try:
        return pid == ancestor or any(parent.pid == ancestor for parent in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def engine_host_tier() -> dict | None:
    """This run's engine's host-tier traffic, from the metrics snapshot it rewrites every upkeep tick.

    The engine's periodic log line comes every 10 s, longer than a short pass,
    so the snapshot (what ``kvelastic status --json`` shows) is the direct
    evidence of spills and reloads. None when no engine of this process is found.
    """
    try:
        from kvelastic.cli import CliError, read_accounts
    except ImportError:
        return None
    try:
        accounts = read_accounts(None)
    except (CliError, OSError):
        return None
    me = os.getpid()
    for account in accounts:
        for member in account["members"]:
            if _descends_from(int(member["pid"]), me):
                return {k: member[k] for k in ("name", "spilled_bytes", "reloaded_bytes", "host_bytes_used")
                        if k in member}
    return None


def main() -> None:
    args = parse_args()
    if args.v1:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if args.connector:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler (and its connector) in this process
    from vllm import SamplingParams, TokensPrompt

    result: dict = {"args": vars(args), "kvelastic": os.environ.get("KVELASTIC", "0"), "passes": []}
    with GpuMemorySampler() as sampler:
        t0 = time.perf_counter()
        llm = build_llm(args)
        result["startup_s"] = time.perf_counter() - t0
        if args.connector:
            result["connector"] = count_connector_transfers(llm)
        sampler.mark("engine ready")
        prompts = make_prompts(1234, args.prompts, args.min_len, args.max_len, args.shared_prefix)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for index in range(args.passes):
            sampler.mark(f"pass {index} start")
            t = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            sampler.mark(f"pass {index} end")
            ttft = [o.metrics.first_token_latency for o in outs if getattr(o, "metrics", None)]
            result["passes"].append({
                "seconds": elapsed,
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "prompt_tokens": sum(len(p) for p in prompts),
                "ttft_s": ttft,
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "cached_tokens": [getattr(o, "num_cached_tokens", None) for o in outs],
            })
        if result["kvelastic"] == "1":
            time.sleep(0.6)  # two upkeep ticks: the snapshot holds the last pass
            result["host_tier"] = engine_host_tier()
        if args.idle_after:
            time.sleep(args.idle_after)
            sampler.mark("idle end")
    result["memory"] = sampler.samples
    result["memory_per_gpu"] = sampler.per_gpu
    result["marks"] = sampler.marks
    result["nvidia_smi_stalls"] = sampler.stalls
    with open(args.out, "w") as f:
        json.dump(result, f)
    p0 = result["passes"][0]
    print(f"RUN kvelastic={result['kvelastic']} v1={args.v1} offload={args.offload} "
          f"startup={result['startup_s']:.1f}s pass0={p0['seconds']:.2f}s "
          f"peak_mem={max((m for _, m in sampler.samples), default=0) / 2**30:.2f}GiB "
          f"cached={sum(c or 0 for c in result['passes'][-1]['cached_tokens'])} "
          f"connector={result.get('connector')} host_tier={result.get('host_tier')}")


if __name__ == "__main__":
    main()
