"""A cold burst, then the same burst warm, under TP=2: what each pass maps, gives back and waits for.

On 2 x H200 (8B, TP=2, ``benchmarks/gpu_session.sh tp``) the warm pass ran at 0.907x vanilla while
each GPU's memory fell during the cold pass and rose again in the warm one. The suspicion was that
empty groups given back as the cold pass's requests finished were asked for again by the warm pass,
each costing steps of confirmation lag. This test runs vLLM's real scheduler in front of two rank
processes with the GPU run's shape, at half its size: 256 blocks per group (256 MiB at TP=2),
16384 batched tokens, prompts of 50-1250 tokens of which a quarter share a 700-token prefix.

What it shows (sync scheduling; async scheduling, measured aside, differs only
in losing two cold steps): the warm pass takes exactly vanilla's steps; the cold pass loses one step,
the first map's confirmation; groups are given back only while the cold pass's prompts still wait
(the demand counts each waiting prompt whole, its cached prefix too, and the surplus goes as they are
admitted with their hits): the fall of memory seen on the GPUs. The warm pass's rise is its own
output blocks (the cold pass's stay cached). Nothing is given back between the passes.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.settings import Settings  # noqa: E402
from tests.kv_fixtures import HALF  # noqa: E402
from tests.scheduler_harness import block_hasher, drive, make_scheduler  # noqa: E402
from tests.test_tp_real_scheduler import engine_over, step_to_ranks  # noqa: E402
from tests.tp_ranks import RankProcesses  # noqa: E402

BLOCKS = 32768  # 128 groups: room for both passes without a limit, as on the GPUs
GROUP_BLOCKS = 256  # an 8B model's group at TP=2 with 8 MiB chunks
BATCH = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}  # vLLM's defaults on an H100 or H200


def gpu_shaped_burst(tag: str, count: int = 128, max_tokens: int = 64) -> list:
    """``benchmarks/vllm_run.py``'s prompts: random lengths, every fourth behind one shared prefix.

    Bodies stop at 1250 tokens (the GPU run's at 1500) to stay within the 2048-token model length.
    """
    from vllm import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(1234)
    prefix = [rng.randrange(1000, 30000) for _ in range(700)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    prompts = []
    for i in range(count):
        body = [rng.randrange(1000, 30000) for _ in range(rng.randint(50, 1250))]
        prompts.append(Request(f"{tag}-{i}", prefix + body if i % 4 == 0 else body, params, None,
                               block_hasher=block_hasher()))
    return prompts


def two_passes() -> list[list]:
    return [gpu_shaped_burst("cold"), gpu_shaped_burst("warm")]


def steps_per_pass(trace: list) -> tuple[int, int]:
    cold = next(i for i, step in enumerate(trace) if any(rid.startswith("warm-") for rid, _ in step))
    return cold, len(trace) - cold


@pytest.fixture
def gpu_shaped_tp(tmp_path, monkeypatch):
    """vLLM's scheduler over two rank processes of :data:`BLOCKS` blocks in groups of :data:`GROUP_BLOCKS`."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    ranks = RankProcesses(shape=(BLOCKS, GROUP_BLOCKS * HALF))
    try:
        # TTL past the run: the GPU run's 2 s outlasted its 1.7 s warm pass; a slow CPU's would not
        scheduler, patcher = engine_over(ranks, Settings(enabled=True, cache_ttl_s=600.0), num_blocks=BLOCKS, **BATCH)
        try:
            yield scheduler, ranks
        finally:
            scheduler.kvelastic_reclaimer.stop()
            patcher.revert()
    finally:
        ranks.close()


def test_a_warm_burst_waits_for_no_group_and_none_is_given_back_between_bursts(gpu_shaped_tp):
    """Step counts against vanilla vLLM on the same two bursts; each step's unmaps against its waiting queue."""
    scheduler, ranks = gpu_shaped_tp
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    assert queue.cache.blocks_per_group == GROUP_BLOCKS
    steps: list[dict] = []

    def forward(s, out):
        commands = out.kvelastic_plan.commands
        steps.append({"waiting": len(s.waiting), "unmaps": sum(len(c[2]) for c in commands if c[1] == "unmap")})
        return step_to_ranks(s, ranks, out, writes_only=True)  # each rank checks every block written is mapped

    trace = drive(scheduler, two_passes(), max_steps=1000, forward=forward)
    ranks.check_map_order()  # every map behind its step's forward launch, and the same steps as before
    vanilla = steps_per_pass(drive(make_scheduler(BLOCKS, **BATCH), two_passes(), max_steps=1000))
    cold, warm = steps_per_pass(trace)
    assert warm == vanilla[1], f"warm pass: {warm} steps, vanilla {vanilla[1]}: requests waited for groups"
    assert cold <= vanilla[0] + 1, f"cold pass: {cold} steps, vanilla {vanilla[0]}: more than the first map's lag"
    # the run's last step may give back what nothing after it would use
    given_back = [i for i, step in enumerate(steps[:-1]) if step["unmaps"] and not step["waiting"]]
    assert not given_back, f"groups given back once no prompt waited, at steps {given_back} (cold pass: {cold})"
