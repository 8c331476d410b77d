"""The scheduler-side CPU of one 16k-prefix request, served from the host tier and then from the GPU.

``bench_reload.py`` times the whole TTFT on a GPU; this script times what the
engine thread does for it on the CPU, where noise is low and profiles are
cheap: vLLM's real Scheduler patched by kvelastic (``scheduler_block_pool``)
over a host-backed elastic cache shaped like the 8B engine's (32 layers,
128 blocks per group, ~40k blocks, a ~1 GiB reserve/4-group prefetch scaled
to that group size), with the host tier and its real copier (on a CPU the
copies are synchronous memcpys, timed apart: they are the GPU's copy time there).

Per repetition: a cold prefill of ``prefix + s0`` (two steps at 16,384 batched
tokens), the prefix idles out (TTL) and its groups are spilled and unmapped,
then ``prefix + s1`` (a host hit of every prefix block: the reload step) and
``prefix + s2`` (a GPU hit of every prefix block). A vanilla Scheduler (no
kvelastic) runs the same GPU hit. Printed: medians of ``schedule()`` wall
time per kind of step, the copier's share, and (``--profile``) the top
functions of the reload steps. ``--json`` writes every number.

    .venv/bin/python scripts/bench_reload_cpu.py --reps 5 --json /tmp/reload-cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = ROOT / "scripts" / "models" / "llama-1b"
BS = 16
HALF = BS * 1 * 32 * 2  # bytes of a block's K (or V) half in one layer


def scheduler_of(num_blocks: int, batched: int, max_len: int, layers: int) -> Any:
    """vLLM's Scheduler with the GPU run's batch limits (16,384 tokens, chunked prefill)."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, max_model_len=max_len, dtype="bfloat16", seed=0)
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=batched, max_model_len=max_len,
                            is_encoder_decoder=False, enable_chunked_prefill=True)
    config = VllmConfig(model_config=model, scheduler_config=sched,
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                        device_config=DeviceConfig(device="cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec([f"l{i}" for i in range(layers)], spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                     block_size=BS, log_stats=False)


def host_cache(runtime: Any, layers: int, num_blocks: int, page_bytes: int) -> tuple[Any, list, Any]:
    """(pool, views, elastic cache) as the engine builds them (the runtime's pool, whose stack has the GPU's
    shared-account gate), over host memory: ``layers`` FlashAttention-shaped (2, N, 16, 1, 32) bf16 tensors."""
    import torch

    try:
        from kvelastic.scheduler.elastic_cache import ElasticKVCache
        from kvelastic.pool.kv_layout import KVGroupLayout, merge_runs, runs_of_view
    except ImportError:  # the session-4 tree (ba0c144): before the layers were split
        from kvelastic.integration.elastic_cache import ElasticKVCache  # type: ignore[no-redef]
        from kvelastic.integration.kv_layout import KVGroupLayout, merge_runs, runs_of_view  # type: ignore
    pool = runtime.new_pool()
    raws = [pool.add_tensor(2 * num_blocks * HALF) for _ in range(layers)]
    views = [raw.view(torch.bfloat16).view(2, num_blocks, BS, 1, 32) for raw in raws]
    per_view = []
    for raw, view in zip(raws, views):
        region = pool.region_of(raw)
        per_view.append((region.region_id, *runs_of_view(view.shape, view.stride(), 2,
                                                          view.data_ptr() - region.address, num_blocks)))
    cache = ElasticKVCache(pool, KVGroupLayout(merge_runs(per_view), num_blocks, page_bytes))
    runtime.publish(cache)
    runtime.finish_allocation()
    return pool, views, cache


def patched_scheduler(args: argparse.Namespace, tmp: str) -> tuple[Any, Any, Any, Any]:
    """A kvelastic-patched scheduler over a host-backed cache built as :func:`host_cache`, in the GPU's
    shared account (as every engine joins it); (scheduler, pool, views, patcher)."""
    import os

    from kvelastic.patches import scheduler_block_pool
    from kvelastic.pool import HostBackend
    from kvelastic.settings import Settings

    os.environ["KVELASTIC_SHARED_DIR"] = tmp
    page = args.group_blocks * HALF
    group = page * 2 * args.layers
    import dataclasses

    wanted = dict(enabled=True, chunk_bytes=page, cache_ttl_s=1.0, reserve_bytes=group, prefetch_bytes=4 * group,
                  cpu_bytes=args.cpu_blocks * (group // args.group_blocks), cpu_policy=args.policy, shared_dir=tmp)
    names = {f.name for f in dataclasses.fields(Settings)}  # older trees read the shared folder from the environment
    settings = Settings(**{k: v for k, v in wanted.items() if k in names})
    try:
        from kvelastic.startup.runtime import Runtime
        from tests.scheduler_harness import scheduler_patcher
        patcher = scheduler_patcher()
    except ImportError:  # the session-4 tree
        from kvelastic.integration.runtime import Runtime  # type: ignore[no-redef]
        from kvelastic.patching.apply import Patcher
        patcher = Patcher()
    runtime = Runtime(settings, HostBackend)
    pool, views, _ = host_cache(runtime, args.layers, args.num_blocks, page)
    scheduler_block_pool.PATCH.apply(patcher, runtime)
    try:
        scheduler = scheduler_of(args.num_blocks, args.batched, args.max_len, args.layers)
    finally:
        for change in list(getattr(patcher, "changes", ())):
            if getattr(change, "on_class", False):
                patcher.undo(change)
    return scheduler, pool, views, patcher


def requests_for(seed: int, prefix_len: int, suffix_len: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 30000) for _ in range(prefix_len)]
    return prefix, [[rng.randrange(1000, 30000) for _ in range(suffix_len)] for _ in range(3)]


class Timed:
    """Wraps ``obj.name`` to add its wall time to ``self.seconds`` and count its calls (``self.calls``);
    ``count(args)`` adds to ``self.items`` (the runs or pages a call maps, say)."""

    def __init__(self, obj: Any, names: tuple[str, ...], count: Callable[..., int] | None = None):
        self.seconds = 0.0
        self.calls = self.items = 0
        self._count = count
        for name in names:
            setattr(obj, name, self._wrap(getattr(obj, name)))

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = self.items = 0

    def _wrap(self, call: Callable) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            self.calls += 1
            if self._count is not None:
                self.items += self._count(*a, **k)
            try:
                return call(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
        return timed


def run_request(scheduler: Any, rid: str, tokens: list[int], probes: dict[str, Timed],
                profiler: Any = None) -> list[dict[str, float]]:
    """One greedy 1-token request to completion; per step: schedule/update wall time, the engine thread's
    CPU in schedule, and what ``probes`` saw in it (copies, waits for the mapper thread, driver-like calls)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from tests.scheduler_harness import block_hasher, model_output

    scheduler.add_request(Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),
                                  None, block_hasher=block_hasher()))
    steps = []
    while scheduler.has_requests():
        for probe in probes.values():
            probe.reset()
        if profiler is not None:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = scheduler.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        if profiler is not None:
            profiler.disable()
        samplers = {r for r in out.num_scheduled_tokens
                    if scheduler.requests[r].num_computed_tokens + out.num_scheduled_tokens[r]
                    >= scheduler.requests[r].num_tokens}
        result = model_output(scheduler, out, samplers)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, result)
        t3 = time.perf_counter()
        step = {"schedule_ms": 1e3 * (t1 - t0), "schedule_cpu_ms": 1e3 * (c1 - c0), "update_ms": 1e3 * (t3 - t2),
                "tokens": sum(out.num_scheduled_tokens.values())}
        for name, probe in probes.items():
            step.update({f"{name}_ms": 1e3 * probe.seconds, f"{name}_calls": probe.calls,
                         f"{name}_items": probe.items})
        steps.append(step)
    return steps


def spill_prefix(scheduler: Any, pool: Any) -> None:
    """As the engine idling past the TTL: the reclaimer spills the prefix's groups and unmaps them."""
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    queue.last_allocation -= 5
    scheduler.kvelastic_reclaimer.tick()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and queue.cached_groups() > 0:
        pool.collect()
        time.sleep(0.005)
    scheduler.kvelastic_reclaimer.tick()
    pool.collect()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import cProfile
    import tempfile

    tmp = tempfile.mkdtemp(prefix="kvelastic-bench-")
    vanilla = scheduler_of(args.num_blocks, args.batched, args.max_len, args.layers)  # before any patch
    scheduler, pool, views, patcher = patched_scheduler(args, tmp)
    offload = scheduler.kvelastic_offload
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    probes = {"copy": Timed(offload.copier, ("load", "store")),
              "map_wait": Timed(queue.mapper, ("map_now",)),  # the engine thread waiting for the mapper thread
              "map_calls": Timed(pool.backend, ("map_runs",), lambda runs, *a, **k: len(runs))}  # runs: one
    # cuMemSetAccess each on a GPU; calls: one stream sync each
    profiler = cProfile.Profile() if args.profile else None
    reps = []
    try:
        for r in range(args.warmup + args.reps):
            prefix, (s0, s1, s2) = requests_for(100 + r, args.prefix_len, args.suffix_len)
            rep: dict[str, Any] = {"cold": run_request(scheduler, f"c{r}", prefix + s0, probes)}
            run_request(vanilla, f"vc{r}", prefix + s0, {})
            hits0 = offload.tier.hits
            spill_prefix(scheduler, pool)
            measured = r >= args.warmup
            rep["reload"] = run_request(scheduler, f"r{r}", prefix + s1, probes, profiler if measured else None)
            rep["host_hits"] = offload.tier.hits - hits0
            rep["gpu_hit"] = run_request(scheduler, f"g{r}", prefix + s2, probes)
            rep["vanilla_gpu_hit"] = run_request(vanilla, f"vg{r}", prefix + s2, {})
            if measured:
                reps.append(rep)
    finally:
        scheduler.kvelastic_reclaimer.stop()
        scheduler.kv_cache_manager.block_pool.free_block_queue.mapper.stop()
        patcher.revert()
        pool.close()
    if profiler is not None:
        profiler.dump_stats(args.profile)
    return {"args": vars(args), "reps": reps}


def table(result: dict[str, Any]) -> list[tuple[str, float]]:
    """Medians over the repetitions of the first step of each request kind."""
    reps = result["reps"]

    def med(kind: str, key: str, less: str | None = None) -> float:
        return statistics.median(r[kind][0][key] - (r[kind][0][less] if less else 0.0) for r in reps)

    rows = [("reload step: schedule() wall ms", med("reload", "schedule_ms")),
            ("  copier (CPU memcpy here) ms", med("reload", "copy_ms")),
            ("  copier batches", med("reload", "copy_calls")),
            ("  waiting for the mapper thread ms", med("reload", "map_wait_ms")),
            ("  mapper round trips", med("reload", "map_wait_calls")),
            ("  map_runs calls (stream syncs)", med("reload", "map_calls_calls")),
            ("  runs mapped (cuMemSetAccess)", med("reload", "map_calls_items")),
            ("  engine-thread CPU less copies ms", med("reload", "schedule_cpu_ms", "copy_ms")),
            ("reload step: update ms", med("reload", "update_ms")),
            ("GPU-hit step: schedule() ms", med("gpu_hit", "schedule_ms")),
            ("GPU-hit step: update ms", med("gpu_hit", "update_ms")),
            ("vanilla GPU-hit: schedule() ms", med("vanilla_gpu_hit", "schedule_ms")),
            ("vanilla GPU-hit: update ms", med("vanilla_gpu_hit", "update_ms")),
            ("host hits per reload", statistics.median(r["host_hits"] for r in reps))]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prefix-len", type=int, default=16384)
    ap.add_argument("--suffix-len", type=int, default=50)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=40536)
    ap.add_argument("--group-blocks", type=int, default=128)
    ap.add_argument("--cpu-blocks", type=int, default=8192)
    ap.add_argument("--policy", default="arc")
    ap.add_argument("--batched", type=int, default=16384)
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--profile", help="write a cProfile of the reload steps here")
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args()
    result = measure(args)
    for name, value in table(result):
        print(f"{name:34s} {value:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "table": dict(table(result))}, indent=1))


if __name__ == "__main__":
    main()
