"""The scheduler's CPU per step under TP on the CPU: vLLM's real Scheduler in front of spawned rank processes.

Issue #19's CPU model: the GPU run's shape (``tests/test_tp_warm_pass.py`` at full
size: 256 prompts of 50-1250 tokens, a quarter behind one 700-token prefix, 128
output tokens, 16384 batched tokens, groups of 256 blocks), sent as a cold burst
then the same burst warm. kvelastic's scheduler is patched as in a TP=2 engine
core (it finds no cache in its process and connects to the ranks from the
descriptions they sent); each step's plan goes to both rank processes, which map
what it says, and their reports come back on the step's output. ``vanilla`` runs vLLM's scheduler alone on the same bursts. Per step:
the engine thread's CPU and wall time of ``schedule`` and ``update_from_output``
(and a hash of what each step handed out, blocks and commands too, to check two trees decide alike),
in :func:`sched_cpu_run.run_config`'s row format, so ``bench_scheduler_cpu.py``
tabulates both modes alike. The ranks' own work is in other processes and not
counted. Needs the repository's ``tests`` package (the rank processes live there).
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # last: a tree put first on PYTHONPATH (an A/B's old side) keeps its kvelastic
    sys.path.append(str(ROOT))

BLOCKS = 65536       # room for both passes without a limit, as on the GPUs
GROUP_BLOCKS = 256   # an 8B model's group at TP=2 with 8 MiB chunks
BATCH = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}


def burst(tag: str, count: int, max_tokens: int) -> list:
    """The GPU run's prompts (``scripts/vllm_run.py``'s shape, bodies cut to fit 2048 tokens)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from tests.scheduler_harness import block_hasher

    rng = random.Random(1234)
    prefix = [rng.randrange(1000, 30000) for _ in range(700)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return [Request(f"{tag}-{i}", (prefix if i % 4 == 0 else []) +
                    [rng.randrange(1000, 30000) for _ in range(rng.randint(50, 1250))],
                    params, None, block_hasher=block_hasher()) for i in range(count)]


def spawn_ranks(world: int) -> Any:
    """``world`` rank processes (the tests' harness), each with a full-size cache."""
    from tests.kv_fixtures import HALF
    from tests.tp_ranks import RankProcesses

    return RankProcesses(layers=(3,) * world, shape=(BLOCKS, GROUP_BLOCKS * HALF))


def _build_tp(shared: str, world: int, make_ranks: Any = spawn_ranks) -> tuple[Any, Any, Any]:
    """kvelastic's patched scheduler over ``world`` ranks (``make_ranks(world)``); its ranks and patcher."""
    from kvelastic.settings import Settings
    from kvelastic.startup.runtime import Runtime
    from tests.scheduler_harness import build_patched
    from tests.test_tp_real_scheduler import _scheduler_with_world

    os.environ["KVELASTIC_SHARED_DIR"] = shared
    ranks = make_ranks(world)
    runtime = Runtime(Settings(enabled=True, cache_ttl_s=600.0))
    runtime.rank_handovers.asked()  # as the engine core's executor does, with the ranks' descriptions
    runtime.rank_handovers.keep_descriptions(ranks.infos)
    scheduler, patcher = build_patched(runtime, lambda: _scheduler_with_world(world, num_blocks=BLOCKS, **BATCH))
    return scheduler, ranks, patcher


def _step(scheduler: Any, out: Any, ranks: Any) -> Any:
    """The forward pass's stand-in: the plan to the ranks (under TP, their reports on the output), one token
    per finished prompt."""
    from kvelastic.tp.report_merger import STEP_ATTR
    from tests.scheduler_harness import model_output

    report = None
    if ranks is not None:
        ranks.send(out.kvelastic_plan)
        report = ranks.merged_report(out.kvelastic_plan)
    samplers = {r for r in out.num_scheduled_tokens
                if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
    output = model_output(scheduler, out, samplers)
    if report is not None:
        setattr(output, STEP_ATTR, report)
    return output


def _handed_out(out: Any) -> str:
    """What a step decided, to compare trees: tokens per request, the blocks given, the ranks' commands."""
    cached = out.scheduled_cached_reqs
    plan = getattr(out, "kvelastic_plan", None)
    return repr((sorted(out.num_scheduled_tokens.items()), [(r.req_id, r.block_ids) for r in out.scheduled_new_reqs],
                 list(zip(cached.req_ids, cached.new_block_ids)), plan.commands if plan is not None else ()))


def _passes(scheduler: Any, ranks: Any, args: argparse.Namespace, probes: Any, trace: Any) -> list[dict]:
    rounds = []
    for index, tag in enumerate(("cold", "warm")):
        for request in burst(tag, args.tp_prompts, args.tp_out_len):
            scheduler.add_request(request)
        start, steps = time.perf_counter(), 0
        while scheduler.has_requests():
            out, sw, sc = probes.timed(scheduler.schedule)
            output = _step(scheduler, out, ranks)
            _, uw, uc = probes.timed(scheduler.update_from_output, out, output)
            probes.steps.append((sw, sc, uw, uc, index, 0.0))
            trace.update(_handed_out(out).encode())
            steps += 1
        rounds.append({"round": index, "warmup": False, "seconds": time.perf_counter() - start, "steps": steps})
    return rounds


def run_tp(args: argparse.Namespace, make_ranks: Any = spawn_ranks) -> dict:
    """One configuration, cold pass then warm, in this process (the ranks, ``args.world`` of them, in
    processes of their own, made by ``make_ranks(world)``: ``bench_rank_step_cpu.py`` passes ranks that time
    themselves)."""
    import kvelastic
    from vllm.utils.gc_utils import freeze_gc_heap

    from sched_cpu_run import CallCounter, Probes, thread_cpu
    from tests.scheduler_harness import make_scheduler

    ranks = patcher = None
    shared = tempfile.mkdtemp(prefix="kvelastic-shared-")
    atexit.register(shutil.rmtree, shared, True)  # registered first: runs after kvelastic's own exit work
    if args.config == "kvelastic":
        scheduler, ranks, patcher = _build_tp(shared, getattr(args, "world", 2), make_ranks)
    else:
        scheduler = make_scheduler(BLOCKS, **BATCH)
    freeze_gc_heap()
    probes, trace = Probes(), hashlib.sha256()
    upkeep = getattr(scheduler, "kvelastic_reclaimer", None)
    probes.start(upkeep, None)  # the upkeep thread's ticks and every garbage collection
    threads0 = thread_cpu()
    probes.counter = CallCounter() if args.count_calls else None
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        probes.timed = _profiled(probes.timed, profiler)
    try:
        rounds = _passes(scheduler, ranks, args, probes, trace)
        threads = {name: round(cpu - threads0.get(name, 0.0), 3) for name, cpu in thread_cpu().items()
                   if name != "MainThread" and cpu > threads0.get(name, 0.0)}
    finally:
        if profiler is not None:
            profiler.dump_stats(args.profile)
        if ranks is not None:
            scheduler.kvelastic_reclaimer.stop()
            patcher.revert()
            ranks.close()
    return {"config": args.config, "tree": str(Path(kvelastic.__file__).resolve().parents[1]),
            "world": getattr(args, "world", 2),
            "rounds": rounds, "steps": probes.steps, "ticks": probes.ticks, "gc": probes.gc, "process_cpu_s": 0.0,
            "other_threads_cpu_s": sum(threads.values()), "thread_cpu_s": threads,
            "trace_hash": trace.hexdigest()[:16],
            "offload": None, "pool": None, "backend_calls": None, "block_bytes": 1,
            "calls_per_step": probes.counter.per_step(len(probes.steps)) if probes.counter else None}


def _profiled(timed: Any, profiler: Any) -> Any:
    """``Probes.timed`` with the profiler on only inside the timed calls (not the ranks' pipes)."""
    def run(call: Any, *args: Any) -> Any:
        profiler.enable()
        try:
            return timed(call, *args)
        finally:
            profiler.disable()

    return run
