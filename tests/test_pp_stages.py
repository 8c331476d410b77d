"""Pipeline parallelism: vLLM's real scheduler driving two stages that hold different layers.

A pipeline stage holds only its own layers' KV tensors, so its page groups have
other sizes than the other stage's, but the same blocks. vLLM broadcasts every
step's output to every stage, and the stages map, confirm and unmap exactly as
tensor-parallel ranks do: the protocol's own cases (maps confirmed by both, a
stage out of memory, a killed stage, the sizes the scheduler counts) run for both
splits in ``tests/test_tp_protocol.py``, ``test_tp_rank_failures.py`` and
``test_tp_host_tier.py``. Here each stage is a process of its own
(one layer, then two) and every block a "forward pass" touches is checked on both,
so a block handed out before both stages mapped it, or unmapped while in use, fails.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from tests.kv_fixtures import RANK_LAYERS, group_bytes  # noqa: E402
from tests.scheduler_harness import make_requests  # noqa: E402
from tests.test_tp_real_scheduler import drive_ranks, tp_engine  # noqa: E402,F401 (a fixture)


def test_every_block_holds_its_tokens_data_on_both_stages(tp_engine):
    scheduler, ranks = tp_engine(split="pipeline")  # built with pipeline_parallel_size=2: never refused
    waves = [make_requests("a", 6, 300, 200, seed=0), make_requests("c", 8, 460, 0, seed=1)]
    trace = drive_ranks(scheduler, ranks, waves)
    assert {rid for step in trace for rid, _ in step} == {r.request_id for wave in waves for r in wave}


def test_spills_and_reloads_keep_every_block_right_on_both_stages(tp_engine):
    scheduler, ranks = tp_engine(limit_groups=3, cpu_bytes=16 * group_bytes(sum(RANK_LAYERS["pipeline"])),
                                 split="pipeline")
    filler = [make_requests(f"f{k}", 4, 400, 0, seed=10 + k) for k in range(3)]
    drive_ranks(scheduler, ranks, [make_requests("a", 4, 320, 0, seed=0), *filler,
                                   make_requests("b", 4, 320, 0, seed=0)])
    assert scheduler.kvelastic_offload.tier.hits >= 40, "the second pass of a's prompts did not come back from the host"
