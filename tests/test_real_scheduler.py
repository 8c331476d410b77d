"""vLLM's real Scheduler, patched by ``scheduler_block_pool``, driven step by step on the CPU.

No model runs: each step's "model output" samples one deterministic token per
request that has finished its prompt, which is all the scheduler reads. The
same request stream goes through a vanilla scheduler and a patched one over a
host-backed elastic cache, and the steps are compared.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.integration.runtime import Runtime  # noqa: E402
from kvelastic.patches import scheduler_block_pool  # noqa: E402
from kvelastic.patching.apply import Patcher  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP, BS, GROUP_BYTES, D, H, N, build_cache  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "scripts" / "models" / "llama-1b"


@functools.lru_cache(maxsize=None)
def _vllm_config(num_blocks: int):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16", seed=0)
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                                is_encoder_decoder=False, enable_chunked_prefill=True)
    config = VllmConfig(model_config=model, scheduler_config=scheduler,
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                        device_config=DeviceConfig(device="cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def _scheduler(num_blocks: int = N, asynchronous: bool = False):
    """vLLM's Scheduler, or with ``asynchronous`` the AsyncScheduler that async scheduling uses."""
    import torch
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = _vllm_config(num_blocks)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["l0", "l1", "l2"], spec)])
    return (AsyncScheduler if asynchronous else Scheduler)(vllm_config=config, kv_cache_config=kv_config,
                     structured_output_manager=StructuredOutputManager(config), block_size=BS, log_stats=False)


@functools.lru_cache(maxsize=None)
def _block_hasher():
    """One hasher per process: each ``init_none_hash`` draws a new random root, which would end all hits."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BS, sha256)


def _requests(tag: str, count: int, prompt_len: int, shared_prefix: int, seed: int, max_tokens: int = 20) -> list:
    """``count`` requests sharing a prefix (prefix-cache hits), with tails drawn from ``seed``."""
    import random

    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = _block_hasher()
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 30000) for _ in range(shared_prefix)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return [Request(f"{tag}-{i}", prefix + [rng.randrange(100, 30000) for _ in range(prompt_len - shared_prefix)],
                    params, None, block_hasher=hasher) for i in range(count)]


def _drive(scheduler, waves: list[list], max_steps: int = 2000, after_step=None) -> list:
    """Run every wave to completion, one after another; returns each step's scheduled tokens per request."""
    from vllm.v1.outputs import ModelRunnerOutput

    trace = []
    for wave in waves:
        for request in wave:
            scheduler.add_request(request)
        while scheduler.has_requests():
            assert len(trace) < max_steps, "the scheduler stopped making progress"
            out = scheduler.schedule()
            ids = sorted(out.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                request = scheduler.requests[rid]
                done_prompt = request.num_computed_tokens >= request.num_tokens
                sampled.append([1000 + (7 * request.num_output_tokens) % 997] if done_prompt else [])
            scheduler.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
                logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
            trace.append(tuple((rid, out.num_scheduled_tokens[rid]) for rid in ids))
            if after_step is not None:
                after_step(scheduler)
    return trace


def _drive_async(scheduler, waves: list[list], max_steps: int = 2000, after_step=None) -> list:
    """As the engine core runs async scheduling: step N+1 is scheduled before step N's output arrives."""
    from collections import deque

    from vllm.v1.outputs import ModelRunnerOutput

    trace: list = []
    in_flight: deque = deque()
    for wave in waves:
        for request in wave:
            scheduler.add_request(request)
        while scheduler.has_requests() or in_flight:
            assert len(trace) < max_steps, "the scheduler stopped making progress"
            if len(in_flight) < 2 and scheduler.has_requests():  # also flushes finished ids, as the engine does
                out = scheduler.schedule()
                samplers = {r for r in out.num_scheduled_tokens if not scheduler.requests[r].is_prefill_chunk}
                in_flight.append((out, samplers))
                trace.append(tuple((rid, out.num_scheduled_tokens[rid]) for rid in sorted(out.num_scheduled_tokens)))
                if len(in_flight) < 2 and scheduler.has_unfinished_requests():
                    continue
            out, samplers = in_flight.popleft()
            ids = sorted(out.num_scheduled_tokens)
            sampled = [[1000 + (7 * scheduler.requests[r].num_output_tokens) % 997]
                       if r in samplers and r in scheduler.requests else [] for r in ids]
            scheduler.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
                logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
            if after_step is not None:
                after_step(scheduler)
    return trace


def _waves() -> list[list]:
    """Two waves of the same prompts (the second must hit the prefix cache the first left), then
    a wave that needs nearly every block at once, where any block miscounted changes the schedule."""
    return [_requests("a", 6, 300, 200, seed=0), _requests("b", 6, 300, 200, seed=0),
            _requests("c", 8, 460, 0, seed=1)]


def _prefill(trace: list, tag: str) -> int:
    """Tokens scheduled for ``tag``'s requests in steps that were not a single decode token."""
    return sum(n for step in trace for rid, n in step if rid.startswith(tag + "-") and n > 1)


def _blocks_in_use_are_all_mapped(scheduler, pool) -> bool:
    """Every block of a running or waiting request lies in a mapped group (never KV in unmapped memory)."""
    cache = scheduler.kv_cache_manager.block_pool.free_block_queue.cache
    manager = scheduler.kv_cache_manager
    ids = [b for rid in scheduler.requests for group in manager.get_block_ids(rid) for b in group]
    return all(pool.is_mapped(cache.group_of_block(b)) for b in ids)


def _check_every_step(pool, mapped: list | None = None):
    def check(scheduler) -> None:
        assert _blocks_in_use_are_all_mapped(scheduler, pool), "a request holds a block in an unmapped group"
        assert _cached_blocks_are_all_mapped(scheduler, pool), "vLLM could hit a block in an unmapped group"
        if mapped is not None:
            mapped.append(pool.stats().mapped_bytes)

    return check


def _cached_blocks_are_all_mapped(scheduler, pool) -> bool:
    """Every block vLLM could serve as a prefix hit lies in a mapped group."""
    from kvelastic.integration.elastic_cache import ElasticKVCache

    block_pool = scheduler.kv_cache_manager.block_pool
    cache: ElasticKVCache = block_pool.free_block_queue.cache
    index = block_pool.cached_block_hash_to_block
    table = getattr(index, "_cache", None)
    assert table is not None, "vLLM's prefix-cache map changed shape; update this test"
    blocks = [b for entry in table.values() for b in (entry.values() if isinstance(entry, dict) else [entry])]
    return all(pool.is_mapped(cache.group_of_block(b.block_id)) for b in blocks)


def _wait_unmapped(pool, at_most: int) -> int:
    """Unmaps run on the mapper thread: wait (briefly) until mapped bytes fall to ``at_most``."""
    import time

    deadline = time.monotonic() + 5
    while pool.stats().mapped_bytes > at_most and time.monotonic() < deadline:
        pool.collect()
        time.sleep(0.01)
    return pool.stats().mapped_bytes


@pytest.fixture
def patched(tmp_path, monkeypatch):
    """A scheduler factory whose schedulers are patched over a host-backed cache; torn down after the test."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    made: list = []
    patcher = Patcher()

    def make(limit_groups: int | None = None, asynchronous: bool = False, **settings):
        pool, views, cache = build_cache(limit_groups)
        runtime = Runtime(Settings(enabled=True, limit_bytes=limit_groups and limit_groups * GROUP_BYTES,
                                   **settings))
        runtime.cache = cache
        patcher.revert()  # one wrapper at a time, pointing at this runtime
        scheduler_block_pool.PATCH.apply(patcher, runtime)
        scheduler = _scheduler(asynchronous=asynchronous)
        made.append((scheduler, pool))
        return scheduler, pool, views

    yield make
    patcher.revert()
    for scheduler, pool in made:
        scheduler.kvelastic_reclaimer.stop()
        scheduler.kv_cache_manager.block_pool.free_block_queue.mapper.stop()
        pool.close()


def test_with_memory_to_spare_the_patched_scheduler_makes_vanillas_decisions(patched):
    vanilla = _drive(_scheduler(), _waves())
    scheduler, _, _ = patched()
    assert type(scheduler.kv_cache_manager.block_pool.free_block_queue).__name__ == "PageAwareFreeQueue"
    assert _drive(scheduler, _waves()) == vanilla
    assert _prefill(vanilla, "b") < _prefill(vanilla, "a") / 10  # the second wave hit the cache


def test_under_a_tight_limit_every_request_finishes_within_it(patched):
    scheduler, pool, _ = patched(limit_groups=2)  # 64 blocks; one wave needs about 80 at once
    mapped = []
    trace = _drive(scheduler, _waves(), after_step=_check_every_step(pool, mapped))
    expected = {f"{w}-{i}" for w in "ab" for i in range(6)} | {f"c-{i}" for i in range(8)}
    assert {rid for step in trace for rid, _ in step} == expected
    assert not scheduler.has_requests()
    assert max(mapped) <= 2 * GROUP_BYTES < N // BLOCKS_PER_GROUP * GROUP_BYTES


@pytest.mark.parametrize("cpu", [False, True], ids=["no-host-tier", "host-tier"])
def test_a_prefix_pushed_out_by_other_work_comes_back_from_the_host_tier(patched, cpu):
    """a, then unrelated work that evicts a's blocks, then a's prompts again."""
    settings = {"cpu_bytes": 16 * GROUP_BYTES} if cpu else {}  # room for every block the test caches
    scheduler, pool, _ = patched(limit_groups=3, **settings)
    filler = [_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
    trace = _drive(scheduler, [_requests("a", 4, 320, 320, seed=0), *filler, _requests("b", 4, 320, 320, seed=0)],
                   after_step=_check_every_step(pool))
    offload = getattr(scheduler, "kvelastic_offload", None)
    if cpu:
        assert offload.tier.hits >= 19 and offload.counters.reloaded_blocks >= 19
        assert _prefill(trace, "b") < _prefill(trace, "a") / 4
    else:
        assert offload is None
        assert _prefill(trace, "b") >= _prefill(trace, "a") * 0.9  # recomputed


def test_a_prefix_cache_reset_forgets_gpu_and_host_copies(patched):
    scheduler, _, _ = patched(limit_groups=3, cpu_bytes=16 * GROUP_BYTES)
    trace = _drive(scheduler, [_requests("a", 4, 320, 320, seed=0)])
    assert scheduler.reset_prefix_cache()
    assert len(scheduler.kvelastic_offload.tier._slot_of) == 0
    trace += _drive(scheduler, [_requests("b", 4, 320, 320, seed=0)])
    assert _prefill(trace, "b") == _prefill(trace, "a")  # recomputed in full, as vanilla would
    trace += _drive(scheduler, [_requests("c", 4, 320, 320, seed=0)])
    assert _prefill(trace, "c") < _prefill(trace, "b") / 4  # the lookup hook survived the reset


def test_aborted_requests_give_their_blocks_back(patched):
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    scheduler, pool, _ = patched()
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    for request in _requests("a", 6, 460, 0, seed=3):
        scheduler.add_request(request)
    for _ in range(3):
        out = scheduler.schedule()
        ids = sorted(out.num_scheduled_tokens)
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[] for _ in ids],
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
    assert queue.num_in_use > 1
    scheduler.finish_requests([f"a-{i}" for i in range(6)], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert queue.num_in_use == 1  # vLLM's null block only


@pytest.mark.parametrize("cpu", [False, True], ids=["no-host-tier", "host-tier"])
def test_an_idle_engine_gives_memory_back_and_keeps_its_prefix_on_the_host(patched, cpu):
    settings = {"cpu_bytes": 16 * GROUP_BYTES} if cpu else {}
    scheduler, pool, _ = patched(cache_ttl_s=0.0, reserve_bytes=0, **settings)
    trace = _drive(scheduler, [_requests("a", 4, 320, 0, seed=0)])  # 80 prompt blocks: three groups
    busy = pool.stats().mapped_bytes
    scheduler.kvelastic_reclaimer.queue.last_allocation -= 2  # as if the engine had idled for 2 s
    scheduler.kvelastic_reclaimer.tick()
    idle = _wait_unmapped(pool, GROUP_BYTES)
    assert idle <= GROUP_BYTES < busy  # only the group holding vLLM's null block stays
    assert _cached_blocks_are_all_mapped(scheduler, pool)
    trace += _drive(scheduler, [_requests("b", 4, 320, 0, seed=0)], after_step=_check_every_step(pool))
    if cpu:
        assert scheduler.kvelastic_offload.tier.hits >= 40
        assert _prefill(trace, "b") < _prefill(trace, "a") / 4
    else:
        assert _prefill(trace, "b") > _prefill(trace, "a") / 2  # most of the prefix died with its memory


def test_a_limit_lowered_mid_run_is_honoured_without_losing_a_request(patched):
    """As ``kvelastic limit NAME 1GiB`` does to a busy engine: running requests finish, memory comes down."""
    scheduler, pool, _ = patched(cache_ttl_s=0.0, reserve_bytes=0)
    steps = []

    def lower_the_limit(s) -> None:
        steps.append(pool.stats().mapped_bytes)
        if len(steps) == 6:
            pool.set_limit(2 * GROUP_BYTES)
            s.kvelastic_reclaimer.tick()
        _check_every_step(pool)(s)

    trace = _drive(scheduler, [_requests("c", 8, 460, 0, seed=1)], after_step=lower_the_limit)
    assert max(steps[:6]) > 2 * GROUP_BYTES  # the wave had more than the new limit before it came
    assert {rid for step in trace for rid, _ in step} == {f"c-{i}" for i in range(8)}
    scheduler.kvelastic_reclaimer.queue.last_allocation -= 2
    scheduler.kvelastic_reclaimer.tick()
    assert _wait_unmapped(pool, 2 * GROUP_BYTES) <= 2 * GROUP_BYTES


def test_async_scheduling_makes_vanillas_decisions_and_keeps_the_invariants(patched):
    """The AsyncScheduler (one step in flight, as vLLM's async scheduling runs it) is patched too."""
    vanilla = _drive_async(_scheduler(asynchronous=True), _waves())
    scheduler, pool, _ = patched(asynchronous=True)
    assert type(scheduler).__name__ == "AsyncScheduler"
    assert _drive_async(scheduler, _waves(), after_step=_check_every_step(pool)) == vanilla
    assert _prefill(vanilla, "b") < _prefill(vanilla, "a") / 10


def test_async_scheduling_under_a_tight_limit_with_the_host_tier(patched):
    scheduler, pool, _ = patched(limit_groups=3, asynchronous=True, cpu_bytes=16 * GROUP_BYTES)
    filler = [_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
    trace = _drive_async(scheduler, [_requests("a", 4, 320, 320, seed=0), *filler,
                                     _requests("b", 4, 320, 320, seed=0)], after_step=_check_every_step(pool))
    assert scheduler.kvelastic_offload.tier.hits >= 19
    assert _prefill(trace, "b") < _prefill(trace, "a") / 4


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_the_invariants_and_finish(patched, seed):
    """Random prompts, shared prefixes, limits, host tier on or off, sync or async scheduling."""
    import random

    rng = random.Random(seed)
    asynchronous = rng.random() < 0.5
    cpu = {"cpu_bytes": rng.choice([2, 16]) * GROUP_BYTES} if rng.random() < 0.6 else {}
    scheduler, pool, _ = patched(limit_groups=rng.choice([2, 3, 5, None]), asynchronous=asynchronous,
                                 cache_ttl_s=rng.choice([0.0, 10.0]), **cpu)
    waves, expected = [], set()
    for w in range(rng.randint(2, 5)):
        count, length = rng.randint(1, 8), rng.randint(20, 700)
        wave = _requests(f"w{w}", count, length, rng.randint(0, length), seed=rng.randrange(4),
                         max_tokens=rng.randint(1, 40))
        waves.append(wave)
        expected |= {r.request_id for r in wave}
    checks = _check_every_step(pool)

    def step(s) -> None:
        checks(s)
        if rng.random() < 0.05:  # now and then the engine idles long enough for the reclaimer
            s.kvelastic_reclaimer.queue.last_allocation -= 20
            s.kvelastic_reclaimer.tick()

    trace = (_drive_async if asynchronous else _drive)(scheduler, waves, after_step=step)
    assert {rid for s in trace for rid, _ in s} == expected
    assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("seed", range(4))
def test_a_reclaimer_ticking_constantly_beside_the_scheduler_breaks_nothing(patched, seed):
    """The reclaimer thread releases idle cached groups while steps run (TTL 0, a tick every millisecond)."""
    import random

    rng = random.Random(100 + seed)
    asynchronous = seed % 2 == 1
    scheduler, pool, _ = patched(limit_groups=rng.choice([3, None]), asynchronous=asynchronous, cache_ttl_s=0.0,
                                 cpu_bytes=16 * GROUP_BYTES)
    reclaimer = scheduler.kvelastic_reclaimer
    reclaimer.stop()
    reclaimer.interval_s = 0.001
    reclaimer._stop.clear()
    reclaimer.start()
    checks = _check_every_step(pool)

    def step(s) -> None:
        with reclaimer.lock:  # the reclaimer changes the queue under this lock: check a settled state
            checks(s)

    waves = [_requests(f"w{w}", rng.randint(2, 6), rng.randint(50, 600), rng.randint(0, 50), seed=rng.randrange(2))
             for w in range(4)]
    trace = (_drive_async if asynchronous else _drive)(scheduler, waves, after_step=step)
    assert {rid for s in trace for rid, _ in s} == {r.request_id for wave in waves for r in wave}
    assert scheduler.kvelastic_offload.counters.spilled_blocks > 0  # the reclaimer did release cached groups
