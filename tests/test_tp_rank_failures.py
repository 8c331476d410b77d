"""The TP protocol when a rank fails: out of memory, killed, or a step behind the others.

Two rank processes with host-backed pools and the real scheduler side, as in
``test_tp_protocol.py`` (the harness: ``tests/tp_cluster.py``); each case runs
for tensor-parallel ranks and for two pipeline stages of different sizes. A
failing rank must turn into a scheduling miss, never a block handed out on
less than every rank's report, and never a wait for that rank (a dead rank is
vLLM's to report: its executor fails the engine).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

from kvelastic.tp.remote_mapper import MAX_REPORTS_WAITED  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP, RANK_LAYERS, group_bytes  # noqa: E402
from tests.tp_cluster import allocate_within, cluster  # noqa: E402,F401 (a fixture)


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_a_rank_out_of_memory_turns_into_a_scheduling_miss(cluster, split):
    layers = RANK_LAYERS[split]
    c = cluster(limits=(None, 3), layers=layers)  # rank 1's GPU has room for 3 groups (the null group included)
    got = allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None
    c.step()  # rank 0 maps the extra groups, rank 1 refuses them
    assert c.allocate(4 * BLOCKS_PER_GROUP) is None, "a group refused by one rank must not be handed out"
    assert c.mapper.pending_commands, "the groups rank 0 did map must be given back"
    c.step()
    assert c.mapped_bytes == [3 * group_bytes(n) for n in layers]
    c.step(writes=[(b.block_id, 5) for b in got], checks=[])
    c.bp.free_blocks(got)
    assert allocate_within(c, 2 * BLOCKS_PER_GROUP - 1)  # the engine keeps serving within what fits


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_a_dead_rank_is_never_waited_for_and_its_groups_never_handed_out(cluster, split, caplog):
    """A killed rank sends no reply: its groups are never adopted, nothing waits for it, and once enough
    reports came without its word the groups asked for are refused (vLLM's executor fails the engine anyway)."""
    c = cluster(layers=RANK_LAYERS[split])
    allocate_within(c, BLOCKS_PER_GROUP)
    os.kill(c.procs[1].pid, signal.SIGKILL)
    c.procs[1].join(10)
    started = time.monotonic()
    assert c.allocate(6 * BLOCKS_PER_GROUP) is None
    with caplog.at_level("ERROR", logger="vllm.kvelastic"):
        for _ in range(MAX_REPORTS_WAITED + 2):
            c.step(live=[0], report=True)
            assert c.allocate(6 * BLOCKS_PER_GROUP) is None, "a group only the live rank mapped was handed out"
    assert "were not reported by every rank; their groups are refused" in caplog.text
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_a_slow_rank_delays_its_groups_and_holds_up_nothing_else(cluster, split):
    """Rank 1 runs a step behind: the groups it has not mapped yet are not handed out, the scheduler
    side never waits for it, and once it catches up the same groups are adopted."""
    layers = RANK_LAYERS[split]
    c = cluster(layers=layers)
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None
    plan = c.mapper.take_plan()
    c.run(plan, live=[0])  # rank 0 maps and reports; rank 1 has not got to this step yet
    started = time.monotonic()
    for _ in range(20):  # vLLM asks for free blocks many times a step: never waits for rank 1
        assert c.allocate(3 * BLOCKS_PER_GROUP) is None, "a group only rank 0 mapped was handed out"
    assert time.monotonic() - started < 1.0
    assert c.mapper.pending_groups >= 3 and c.mapped_bytes[0] >= 3 * group_bytes(layers[0])
    c.run(plan, live=[1])  # rank 1 catches up with the same step
    blocks = c.allocate(3 * BLOCKS_PER_GROUP)
    assert blocks is not None, "the groups both ranks mapped must be adopted"
    c.step(writes=[(b.block_id, 9) for b in blocks])
    c.step(checks=[(b.block_id, 9) for b in blocks])  # both ranks hold the data their layers wrote
