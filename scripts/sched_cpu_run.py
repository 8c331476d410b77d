"""One tree's run of ``bench_scheduler_cpu.py``, in this process: vLLM's real Scheduler, patched by kvelastic.

Whichever kvelastic the interpreter imports attaches through its activation
path to a Scheduler over an elastic KV cache of host memory (with the host
tier), and the multi-turn workload runs on it: per step the engine thread's
CPU and wall time of ``schedule`` and ``update_from_output``; per tick the
upkeep thread's CPU; every garbage collection; the backend calls that are
driver calls on a GPU. :func:`run_config` returns it all as one JSON-able dict.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_multiturn import conversations  # noqa: E402

from kvelastic.pool import HostBackend  # noqa: E402  (imports neither torch nor vLLM)

MODEL = Path(__file__).resolve().parent / "models" / "llama-1b"
BLOCK_SIZE = 16


def vllm_config(args: argparse.Namespace, num_blocks: int) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, max_model_len=args.max_model_len,
                        dtype="bfloat16", seed=0)
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                                max_model_len=args.max_model_len, is_encoder_decoder=False,
                                enable_chunked_prefill=True)
    config = VllmConfig(model_config=model, scheduler_config=scheduler,
                        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
                        device_config=DeviceConfig(device="cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def make_scheduler(args: argparse.Namespace, num_blocks: int) -> Any:
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = vllm_config(args, num_blocks)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=args.heads, head_size=args.head_size,
                             dtype=torch.bfloat16)
    layers = [f"l{i}" for i in range(args.layers)]
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv_config,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
                     log_stats=False)


def block_bytes(args: argparse.Namespace) -> int:
    """Bytes of one block over every layer, K and V (bf16)."""
    return 2 * args.layers * BLOCK_SIZE * args.heads * args.head_size * 2


def kvelastic_environment(args: argparse.Namespace, shared_dir: str) -> dict[str, str]:
    """The settings as an engine gets them; the limit and host tier in blocks of this run's shape."""
    return {"KVELASTIC_LIMIT": str(args.limit_blocks * block_bytes(args)),
            "KVELASTIC_CPU_BYTES": str(args.cpu_blocks * block_bytes(args)),
            "KVELASTIC_CPU_POLICY": args.cpu_policy, "KVELASTIC_CHUNK_SIZE": f"{args.chunk_mib}MiB",
            "KVELASTIC_SHARED_DIR": shared_dir}


class CountingHostBackend(HostBackend):
    """The host backend, counting the calls that are driver calls on a GPU: create, map (and zero), unmap."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = dict.fromkeys(("create_page", "map_runs", "pages_mapped", "pages_zeroed", "unmap"), 0)

    def create_page(self, nbytes: int) -> Any:
        self.calls["create_page"] += 1
        return super().create_page(nbytes)

    def map_runs(self, runs: Any, page_bytes: int, *, zero: bool) -> None:
        pages = sum(len(run.handles) for run in runs)
        self.calls["map_runs"] += 1
        self.calls["pages_mapped"] += pages
        self.calls["pages_zeroed"] += pages if zero else 0
        super().map_runs(runs, page_bytes, zero=zero)

    def unmap(self, address: int, nbytes: int) -> None:
        self.calls["unmap"] += 1
        super().unmap(address, nbytes)


def patched_scheduler(args: argparse.Namespace) -> tuple[Any, dict]:
    """A Scheduler patched by kvelastic over a host-backed elastic cache; its pool, backend and tensors.

    Goes through what every kvelastic tree has: ``activate`` with the
    scheduler patch only and the host backend, a pool from the runtime (whose
    stack has the shared-budget gate, so the engine joins a GPU account in
    ``KVELASTIC_SHARED_DIR``), the KV tensors as vLLM's FlashAttention layout
    shapes them, and the cache published to the runtime.
    """
    import dataclasses

    import torch

    try:
        from kvelastic.startup.activate import activate
        from kvelastic.scheduler.elastic_cache import ElasticKVCache
        from kvelastic.pool.kv_layout import KVGroupLayout, merge_runs, runs_of_view
    except ImportError:  # a tree from before the layers (06f4fad, the A/B's old side)
        from kvelastic.integration.activate import activate  # type: ignore[no-redef]
        from kvelastic.integration.elastic_cache import ElasticKVCache  # type: ignore[no-redef]
        from kvelastic.integration.kv_layout import KVGroupLayout, merge_runs, runs_of_view  # type: ignore
    from kvelastic.patches import scheduler_block_pool
    from kvelastic.settings import Settings

    settings = dataclasses.replace(Settings.from_env(), enabled=True)
    backends: list[CountingHostBackend] = []

    def backend() -> CountingHostBackend:
        backends.append(CountingHostBackend())
        return backends[-1]

    activation = activate(settings, patches=[scheduler_block_pool.PATCH], backend_factory=backend)
    runtime = activation.runtime
    pool = runtime.new_pool()
    n = args.num_blocks
    half = BLOCK_SIZE * args.heads * args.head_size * 2
    raws = [pool.add_tensor(2 * n * half) for _ in range(args.layers)]
    views = [raw.view(torch.bfloat16).view(2, n, BLOCK_SIZE, args.heads, args.head_size) for raw in raws]
    per_view = []
    for raw, view in zip(raws, views):
        region = pool.region_of(raw)
        per_view.append((region.region_id, *runs_of_view(view.shape, view.stride(), 2,
                                                          view.data_ptr() - region.address, n)))
    runtime.publish(ElasticKVCache(pool, KVGroupLayout(merge_runs(per_view), n, settings.chunk_bytes)))
    runtime.finish_allocation()
    return make_scheduler(args, n), {"views": views, "pool": pool, "backends": backends}


def model_output(scheduler: Any, out: Any) -> Any:
    """One deterministic token for each scheduled request whose prompt is done (all the scheduler reads)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = sorted(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([1000 + (7 * request.num_output_tokens) % 997] if done else [])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[])


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process (Linux /proc), by name: Python's name, else the OS's."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            head, _, tail = (task / "stat").read_text().rpartition(")")
        except OSError:
            continue
        name = names.get(int(task.name), head.partition("(")[2] or "?")
        fields = tail.split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


class CallCounter:
    """Calls made inside the scheduler's entry points, by area and function: counted, so free of noise.

    A profile hook (``sys.setprofile``) on the engine thread only; it slows
    every call, so a run that counts reports no timings worth reading.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            area = "kvelastic" if "kvelastic" in path or "/patches/" in path else "vllm" if "vllm" in path else "other"
            self.counts[(area, frame.f_code.co_name)] += 1
        elif event == "c_call":
            self.counts[("C", "")] += 1

    def per_step(self, steps: int) -> dict[str, Any]:
        areas: collections.Counter[str] = collections.Counter()
        for (area, _), n in self.counts.items():
            areas[area] += n
        top = [(name, round(n / steps, 1)) for (area, name), n in self.counts.most_common() if area == "kvelastic"]
        return {"areas": {a: round(n / steps, 1) for a, n in areas.items()}, "kvelastic_top": top[:12]}


class Probes:
    """What the measured rounds record: per step, per upkeep tick, per garbage collection."""

    def __init__(self) -> None:
        #: schedule wall/CPU, update wall/CPU, round, and the CPU of the step's host-tier copies (in the schedule)
        self.steps: list[tuple[float, float, float, float, int, float]] = []
        self.copy_cpu = 0.0  # of the step in progress
        self.counter: CallCounter | None = None
        self.ticks: list[tuple[float, float]] = []  # the upkeep thread's CPU and wall seconds per tick
        self.gc = {g: [0, 0.0] for g in range(3)}  # generation: collections, seconds
        self._gc_start = 0.0

    def timed(self, call: Any, *args: Any) -> tuple[Any, float, float]:
        if self.counter is None:  # no setprofile at all: clearing it would stop a cProfile run with --profile
            w, c = time.perf_counter(), time.thread_time()
            result = call(*args)
            return result, time.perf_counter() - w, time.thread_time() - c
        w, c = time.perf_counter(), time.thread_time()
        sys.setprofile(self.counter)
        try:
            result = call(*args)
        finally:
            sys.setprofile(None)
        return result, time.perf_counter() - w, time.thread_time() - c

    def start(self, upkeep: Any, copier: Any) -> None:
        """From now on: each tick of the running upkeep thread (its loop looks ``tick`` up each time), each GC,
        and the host tier's copies, the same work in every tree and the noisiest (memory bandwidth)."""
        gc.callbacks.append(self._on_gc)
        for name in ("store", "load") if copier is not None else ():
            setattr(copier, name, self._copy_timer(getattr(copier, name)))
        if upkeep is not None:
            tick = upkeep.tick

            def timed_tick() -> None:
                _, w, c = self.timed(tick)
                self.ticks.append((c, w))

            upkeep.tick = timed_tick

    def _copy_timer(self, copy: Any) -> Any:
        def timed_copy(*args: Any, **kwargs: Any) -> Any:
            c = time.thread_time()
            try:
                return copy(*args, **kwargs)
            finally:
                self.copy_cpu += time.thread_time() - c

        return timed_copy

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc[info["generation"]][0] += 1
            self.gc[info["generation"]][1] += time.perf_counter() - self._gc_start


def one_round(scheduler: Any, convs: list, args: argparse.Namespace, tag: str, probes: Probes,
              round_index: int, trace: Any) -> int:
    """Every conversation's turns in order, each re-sending the whole history; returns the steps taken."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = block_hasher()
    params = SamplingParams(max_tokens=args.out_len, ignore_eos=True, temperature=0.0)
    histories: list[list[int]] = [[] for _ in convs]
    steps = 0
    for t in range(args.turns):
        requests = [Request(f"{tag}-t{t}-c{i}", h + c[t], params, None, block_hasher=hasher)
                    for i, (h, c) in enumerate(zip(histories, convs))]
        for request in requests:
            scheduler.add_request(request)
        while scheduler.has_requests():
            out, sw, sc = probes.timed(scheduler.schedule)
            output = model_output(scheduler, out)
            _, uw, uc = probes.timed(scheduler.update_from_output, out, output)
            probes.steps.append((sw, sc, uw, uc, round_index, probes.copy_cpu))
            probes.copy_cpu = 0.0
            trace.update(repr(sorted(out.num_scheduled_tokens.items())).encode())
            steps += 1
        for i, request in enumerate(requests):
            histories[i] = request.prompt_token_ids + list(request.output_token_ids)
    return steps


@functools.lru_cache(maxsize=None)
def block_hasher() -> Any:
    """vLLM's request block hasher; one per process (each ``init_none_hash`` draws a new root)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK_SIZE, sha256)


def run_config(args: argparse.Namespace) -> dict:
    """One configuration in this process: the rounds, their step times, the host tier's and pool's counts."""
    import kvelastic
    from vllm.utils.gc_utils import freeze_gc_heap

    if args.config == "kvelastic":
        scheduler, keep = patched_scheduler(args)
    else:  # vanilla vLLM with the physical limit as its whole KV cache, no host tier
        scheduler, keep = make_scheduler(args, args.limit_blocks), {}
    freeze_gc_heap()  # as vLLM's EngineCore does once the scheduler exists
    probes, trace, rounds, profiler = Probes(), hashlib.sha256(), [], None
    upkeep = getattr(scheduler, "kvelastic_reclaimer", None)
    for r in range(args.warmup + args.rounds):
        convs = conversations(args.conversations, args.first_len, args.turn_len, seed=7 + r)
        if r == args.warmup:
            cpu0, thread0, threads0 = time.process_time(), time.thread_time(), thread_cpu()
            probes.start(upkeep, getattr(getattr(scheduler, "kvelastic_offload", None), "copier", None))
            probes.counter = CallCounter() if args.count_calls else None
            if args.profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
        start = time.perf_counter()
        steps = one_round(scheduler, convs, args, f"r{r}", probes, r, trace)
        rounds.append({"round": r, "warmup": r < args.warmup, "seconds": time.perf_counter() - start,
                       "steps": steps})
    process_cpu, engine_thread_cpu = time.process_time() - cpu0, time.thread_time() - thread0
    threads = {name: round(cpu - threads0.get(name, 0.0), 3) for name, cpu in thread_cpu().items()
               if name != "MainThread" and cpu > threads0.get(name, 0.0)}
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    if upkeep is not None:
        upkeep.stop()
    gc.unfreeze()  # as EngineCore does at shutdown: what exits is collected as usual
    offload = getattr(scheduler, "kvelastic_offload", None)
    measured = [row for row in probes.steps if row[4] >= args.warmup]
    return {"config": args.config, "tree": str(Path(kvelastic.__file__).resolve().parents[1]),
            "rounds": rounds, "steps": measured,
            "ticks": probes.ticks, "gc": probes.gc, "process_cpu_s": process_cpu,
            "other_threads_cpu_s": process_cpu - engine_thread_cpu, "thread_cpu_s": threads,
            "trace_hash": trace.hexdigest()[:16], "offload": offload.stats() if offload is not None else None,
            "pool": keep["pool"].stats().as_dict() if keep else None,
            "backend_calls": keep["backends"][-1].calls if keep else None, "block_bytes": block_bytes(args),
            "calls_per_step": probes.counter.per_step(len(measured)) if probes.counter else None}
