"""One scheduler, two worker ranks in separate processes, host-backed pools: the TP protocol's mapping.

The scheduler side is the real one (vLLM's BlockPool made page-aware over a
:class:`ShardedKVCache` and a :class:`RemoteMapper`); each rank is a process of
its own with its pool and :class:`RankWorker` (the harness: ``tests/tp_cluster.py``
over ``tests/tp_ranks.py``). Steps travel over a pipe as vLLM's broadcast would
carry them: the plan, then the blocks the "forward pass" writes and reads; the
ranks' replies come back merged as vLLM's executor merges them. Every rank
checks that each block it touches is mapped and holds what was written, so a
block handed out before every rank mapped it, or unmapped while still in use,
fails the test. Here: maps, unmaps, commands queued between steps, the warm
reserve. A rank out of memory, dead or slow: ``test_tp_rank_failures.py``; the
host tier and the pipeline stages' sizes: ``test_tp_host_tier.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

from kvelastic.tp.protocol import UNMAP  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP, GROUP_BYTES, RANK_LAYERS, group_bytes  # noqa: E402
from tests.tp_cluster import allocate_within, cluster, wait_for  # noqa: E402,F401 (cluster: a fixture)


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_blocks_are_handed_out_only_once_every_rank_mapped_them(cluster, split):
    layers = RANK_LAYERS[split]
    c = cluster(layers=layers)
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None  # nothing confirmed yet: a scheduling miss
    assert c.mapper.pending_commands, "the miss must turn into map commands for the next step"
    blocks = allocate_within(c, 3 * BLOCKS_PER_GROUP)
    groups = {c.cache.group_of_block(b.block_id) for b in blocks}
    assert groups <= c.mapper.mapped_groups and not c.mapper.pending_groups
    c.step(writes=[(b.block_id, 7) for b in blocks])
    c.step(checks=[(b.block_id, 7) for b in blocks])  # every rank still holds what its layers wrote
    assert all(m >= 3 * group_bytes(n) for m, n in zip(c.mapped_bytes, layers))


def test_freed_groups_are_unmapped_on_every_rank_with_the_next_step(cluster):
    c = cluster()
    blocks = allocate_within(c, 4 * BLOCKS_PER_GROUP)
    c.step(writes=[(b.block_id, 3) for b in blocks])
    peak = list(c.mapped_bytes)
    c.bp.free_blocks(blocks)
    c.queue.set_idle()
    c.step()
    assert all(after < before for after, before in zip(c.mapped_bytes, peak))
    assert c.mapped_bytes[0] == c.mapped_bytes[1]


def test_commands_queued_while_a_step_is_in_flight_ride_the_next_step_never_overtaking_it(cluster):
    c = cluster()
    blocks = allocate_within(c, 2 * BLOCKS_PER_GROUP)
    in_flight = c.mapper.take_plan()  # a step is sent but the ranks have not run it yet
    c.bp.free_blocks(blocks)
    c.queue.set_idle()
    c.cache.pool.collect()  # the reclaimer's tick: no engine loop to wake here, so nothing leaves before a step
    queued = c.mapper.pending_commands
    assert queued and not c.cache.pool.idle_steps.steps_asked
    c.run(in_flight, writes=[(b.block_id, 1) for b in blocks])  # the step still writes its blocks: all mapped
    nxt = c.mapper.take_plan()
    unmaps = [command for command in nxt.commands if command[1] == UNMAP]
    assert unmaps and min(command[0] for command in nxt.commands) > max(
        (command[0] for command in in_flight.commands), default=0), "a queued command overtook the step in flight"
    held = list(c.mapped_bytes)
    c.run(nxt)
    assert c.mapped_bytes[0] == c.mapped_bytes[1] < held[0], "the ranks kept the freed groups"


def _held_after_a_report(c) -> list[int]:
    c.step(report=True)
    return c.mapper.rank_held_bytes()


def test_ranks_keep_the_warm_reserve_the_reclaimer_asks_for(cluster):
    c = cluster()
    c.step()  # the null group and one group mapped ahead
    baseline = _held_after_a_report(c)
    pages = 2 * GROUP_BYTES // c.cache.pool.page_bytes
    c.cache.pool.grow_reserve(pages)
    assert c.cache.pool.stats().reserve_bytes == 2 * GROUP_BYTES
    c.step()
    assert wait_for(lambda: _held_after_a_report(c) == [v + 2 * GROUP_BYTES for v in baseline]), \
        "the ranks did not build the warm reserve"
    c.cache.pool.trim_reserve(0)
    c.step()
    assert _held_after_a_report(c) == baseline


def test_groups_mapped_for_waiting_requests_are_not_released_before_they_are_used(cluster):
    c = cluster()
    c.queue.want_blocks(4 * BLOCKS_PER_GROUP)  # a waiting request needs four groups more
    c.step()
    c.allocate(2)  # a small allocation (a decoding request) first: the queue re-sizes its prefetch
    assert c.bp.get_num_free_blocks() >= 4 * BLOCKS_PER_GROUP, "groups mapped for the request were released"
    assert c.allocate(4 * BLOCKS_PER_GROUP) is not None
