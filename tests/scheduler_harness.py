"""Drive vLLM's real Scheduler on the CPU: configs, requests, a stand-in model output, invariants.

No model runs: each step's "model output" samples one deterministic token per
request whose prompt is done, which is all the scheduler reads. Shared by the
single-process and tensor-parallel real-scheduler tests.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from pathlib import Path
from typing import Any, Iterator

from tests.kv_fixtures import BS, D, H, N

MODEL = Path(__file__).resolve().parents[1] / "scripts" / "models" / "llama-1b"


@functools.lru_cache(maxsize=None)
def vllm_config(num_blocks: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 256):
    """A small engine's config by default; the GPU benchmarks' batch limits where a test asks for them."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16", seed=0)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=2048, is_encoder_decoder=False, enable_chunked_prefill=True)
    config = VllmConfig(model_config=model, scheduler_config=scheduler,
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                        device_config=DeviceConfig(device="cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def make_scheduler(num_blocks: int = N, asynchronous: bool = False, kv_cache_config=None, config=None, **batch):
    """vLLM's Scheduler, or with ``asynchronous`` the AsyncScheduler that async scheduling uses;
    ``batch``: :func:`vllm_config`'s batch limits. ``kv_cache_config`` and ``config`` (a VllmConfig), where
    given, replace the one full-attention group and :func:`vllm_config`'s config."""
    import torch
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = vllm_config(num_blocks, **batch) if config is None else config
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    kv_config = kv_cache_config
    if kv_config is None:
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(["l0", "l1", "l2"], spec)])
    return (AsyncScheduler if asynchronous else Scheduler)(vllm_config=config, kv_cache_config=kv_config,
                     structured_output_manager=StructuredOutputManager(config), block_size=BS, log_stats=False)


@functools.lru_cache(maxsize=None)
def block_hasher():
    """One hasher per process: each ``init_none_hash`` draws a new random root, which would end all hits."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BS, sha256)


def make_requests(tag: str, count: int, prompt_len: int, shared_prefix: int, seed: int, max_tokens: int = 20) -> list:
    """``count`` requests sharing a prefix (prefix-cache hits), with tails drawn from ``seed``."""
    import random

    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = block_hasher()
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 30000) for _ in range(shared_prefix)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return [Request(f"{tag}-{i}", prefix + [rng.randrange(100, 30000) for _ in range(prompt_len - shared_prefix)],
                    params, None, block_hasher=hasher) for i in range(count)]


def _index_of(ids: list[str]) -> dict:
    """``req_id_to_index`` where vLLM's output carries it (up to 0.33; 0.34 indexes by ``req_ids`` alone)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" in {field.name for field in dataclasses.fields(ModelRunnerOutput)}:
        return {"req_id_to_index": {r: i for i, r in enumerate(ids)}}
    return {}


def model_output(scheduler, out, samplers: set[str]):
    """The stand-in model output: one deterministic token for each request in ``samplers``."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = sorted(out.num_scheduled_tokens)
    sampled = [[1000 + (7 * scheduler.requests[r].num_output_tokens) % 997]
               if r in samplers and r in scheduler.requests else [] for r in ids]
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                             pooler_output=[], **_index_of(ids))


def step_of(out) -> tuple:
    return tuple((rid, out.num_scheduled_tokens[rid]) for rid in sorted(out.num_scheduled_tokens))


def drive(scheduler, waves: list[list], max_steps: int = 2000, after_step=None, forward=None) -> list:
    """Run every wave to completion, one after another; returns each step's scheduled tokens per request.

    ``forward(scheduler, output)`` runs between a step's scheduling and its output, as the model would;
    what it returns (a dict, or None) is set on the step's model output, as the workers' replies carry it.
    """
    trace = []
    for wave in waves:
        for request in wave:
            scheduler.add_request(request)
        while scheduler.has_requests():
            assert len(trace) < max_steps, "the scheduler stopped making progress"
            out = scheduler.schedule()
            carried = forward(scheduler, out) if forward is not None else None
            samplers = {r for r in out.num_scheduled_tokens
                        if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
            result = model_output(scheduler, out, samplers)
            for name, value in (carried or {}).items():
                setattr(result, name, value)
            scheduler.update_from_output(out, result)
            trace.append(step_of(out))
            if after_step is not None:
                after_step(scheduler)
    return trace


def drive_async(scheduler, waves: list[list], max_steps: int = 2000, after_step=None, forward=None) -> list:
    """As the engine core runs async scheduling: step N+1 is scheduled before step N's output arrives.

    ``forward(scheduler, output)`` runs right after a step's scheduling (the engine sends it at once); what
    it returns is set on that step's model output, as with :func:`drive`."""
    from collections import deque

    trace: list = []
    in_flight: deque = deque()
    for wave in waves:
        for request in wave:
            scheduler.add_request(request)
        while scheduler.has_requests() or in_flight:
            assert len(trace) < max_steps, "the scheduler stopped making progress"
            if len(in_flight) < 2 and scheduler.has_requests():  # also flushes finished ids, as the engine does
                out = scheduler.schedule()
                carried = forward(scheduler, out) if forward is not None else None
                samplers = {r for r in out.num_scheduled_tokens if not scheduler.requests[r].is_prefill_chunk}
                in_flight.append((out, samplers, carried))
                trace.append(step_of(out))
                if len(in_flight) < 2 and scheduler.has_unfinished_requests():
                    continue
            out, samplers, carried = in_flight.popleft()
            result = model_output(scheduler, out, samplers)
            for name, value in (carried or {}).items():
                setattr(result, name, value)
            scheduler.update_from_output(out, result)
            if after_step is not None:
                after_step(scheduler)
    return trace


def repeat_waves() -> list[list]:
    """Two waves of the same prompts (the second must hit the prefix cache the first left), then
    a wave that needs nearly every block at once, where any block miscounted changes the schedule."""
    return [make_requests("a", 6, 300, 200, seed=0), make_requests("b", 6, 300, 200, seed=0),
            make_requests("c", 8, 460, 0, seed=1)]


def prefill(trace: list, tag: str) -> int:
    """Tokens scheduled for ``tag``'s requests in steps that were not a single decode token."""
    return sum(n for step in trace for rid, n in step if rid.startswith(tag + "-") and n > 1)


def replayable_clock(queue) -> None:
    """Give a page-aware queue a clock a second further on each reading, for hypothesis's state machines.

    The queue caches the pool's room for a millisecond and orders cached groups by when they were used:
    on the real clock a replayed example could take another branch (a limit change seen or not yet),
    draw differently, and hypothesis refuses such an example as flaky. On this clock every reading
    is later than the last and no cached figure outlives the next step.
    """
    ticks = itertools.count()
    queue._clock = queue.room.clock = lambda: float(next(ticks))


def scheduler_lock(scheduler):
    """The lock vLLM's entry points run under once patched; kvelastic's upkeep thread changes the block
    pool (and vLLM's prefix-cache map) under it every tick, so a check between steps reads under it too."""
    return scheduler.kvelastic_reclaimer.lock


def blocks_in_use_are_all_mapped(scheduler, pool) -> bool:
    """Every block of a running or waiting request lies in a mapped group (never KV in unmapped memory)."""
    cache = scheduler.kv_cache_manager.block_pool.free_block_queue.cache
    manager = scheduler.kv_cache_manager
    with scheduler_lock(scheduler):
        ids = [b for rid in scheduler.requests for group in manager.get_block_ids(rid) for b in group]
        return all(pool.is_mapped(cache.group_of_block(b)) for b in ids)


def check_every_step(pool, mapped: list | None = None):
    def check(scheduler) -> None:
        assert blocks_in_use_are_all_mapped(scheduler, pool), "a request holds a block in an unmapped group"
        assert cached_blocks_are_all_mapped(scheduler, pool), "vLLM could hit a block in an unmapped group"
        if mapped is not None:
            mapped.append(pool.stats().mapped_bytes)

    return check


def cached_blocks_are_all_mapped(scheduler, pool) -> bool:
    """Every block vLLM could serve as a prefix hit lies in a mapped group."""
    from kvelastic.scheduler.elastic_cache import ElasticKVCache

    block_pool = scheduler.kv_cache_manager.block_pool
    cache: ElasticKVCache = block_pool.free_block_queue.cache
    index = block_pool.cached_block_hash_to_block
    table = getattr(index, "_cache", None)
    assert table is not None, "vLLM's prefix-cache map changed shape; update this test"
    with scheduler_lock(scheduler):
        entries = [e for entry in table.values() for e in (entry.values() if isinstance(entry, dict) else [entry])]
        # Up to 0.33 the map holds blocks (a dict of them for a hash cached twice); from 0.34 block ids, the
        # further ids of a hash cached twice in ``_dup_ids``.
        ids = [e if isinstance(e, int) else e.block_id for e in entries]
        ids += [i for dup in getattr(index, "_dup_ids", {}).values() for i in dup]
        return all(pool.is_mapped(cache.group_of_block(i)) for i in ids)


def wait_unmapped(pool, at_most: int) -> int:
    """Unmaps run on the mapper thread: wait (briefly) until mapped bytes fall to ``at_most``."""
    import time

    deadline = time.monotonic() + 5
    while pool.stats().mapped_bytes > at_most and time.monotonic() < deadline:
        pool.collect()
        time.sleep(0.01)
    return pool.stats().mapped_bytes


@functools.lru_cache(maxsize=None)
def _scheduler_gate():
    from kvelastic.patches import scheduler_block_pool
    from kvelastic.patching import gate
    from kvelastic.patching.versions import installed_vllm_version

    return gate.check([scheduler_block_pool.PATCH], installed_vllm_version())


def scheduler_patcher():
    """A fresh Patcher that the gate cleared for the scheduler patch's contacts on the installed vLLM."""
    from kvelastic.patching.apply import Patcher

    return Patcher.for_gate(_scheduler_gate())


@contextlib.contextmanager
def applied_patch(patch_module: Any, runtime: Any) -> Iterator[Any]:
    """``patch_module``'s patch applied for ``runtime`` on the installed vLLM, its contacts checked first;
    reverted on leaving. Yields the Patcher."""
    from kvelastic.patching.apply import Patcher
    from kvelastic.patching.gate import check_target
    from kvelastic.patching.versions import installed_vllm_version

    version = installed_vllm_version()
    problems = [p for p in (check_target(t, version) for t in patch_module.TARGETS) if p]
    assert not problems, problems
    patcher = Patcher(version, patch_module.TARGETS)
    patch_module.PATCH.apply(patcher, runtime)
    try:
        yield patcher
    finally:
        patcher.revert()


def build_patched(runtime, build):
    """``build()``'s scheduler, made with ``scheduler_block_pool`` applied for ``runtime``; and its Patcher.

    The class wrap is undone once the scheduler exists, so the Patcher keeps
    only the changes made to that scheduler's objects (``revert`` undoes them).
    """
    from kvelastic.patches import scheduler_block_pool

    patcher = scheduler_patcher()
    scheduler_block_pool.PATCH.apply(patcher, runtime)
    try:
        return build(), patcher
    finally:
        for change in patcher.changes:
            if change.on_class:
                patcher.undo(change)


class PatchedSchedulers:
    """Schedulers patched by ``scheduler_block_pool`` over given host-backed caches, torn down together.

    Each scheduler is built by :func:`build_patched` with a Patcher of its own,
    pointing at that scheduler's runtime. :meth:`close` stops every
    scheduler's threads and reverts the changes made to its objects.
    """

    def __init__(self) -> None:
        self.made: list = []

    def make(self, pool, views, cache, settings, asynchronous: bool = False, budget_source=None,
             kv_cache_config=None, config=None):
        """``budget_source``: the pool's shared-account gate, so the scheduler joins the GPU's account;
        ``kv_cache_config``, ``config``: :func:`make_scheduler`'s."""
        from kvelastic.startup.runtime import Runtime

        runtime = Runtime(settings)
        runtime.cache = cache
        runtime.budget = budget_source
        scheduler, patcher = build_patched(runtime, lambda: make_scheduler(asynchronous=asynchronous,
                                                                            kv_cache_config=kv_cache_config,
                                                                            config=config))
        self.made.append((scheduler, pool, views, patcher))  # the views keep the KV tensors' memory alive
        return scheduler

    def close(self) -> None:
        for scheduler, pool, _, patcher in self.made:
            scheduler.kvelastic_reclaimer.stop()
            scheduler.kv_cache_manager.block_pool.free_block_queue.mapper.stop()
            patcher.revert()
            pool.close()
