"""One scheduler, two worker ranks in separate processes, host-backed pools: the TP protocol's mapping.

The scheduler side is the real one (vLLM's BlockPool made page-aware over a
:class:`ShardedKVCache` and a :class:`RemoteMapper`); each rank is a spawned
process with its own pool and :class:`RankWorker` (the harness:
``tests/kv_fixtures.py``). Steps travel over a pipe as vLLM's broadcast would
carry them: the plan, then the blocks the "forward pass" writes and reads.
Every rank checks that each block it touches is mapped and holds what was
written, so a block handed out before every rank mapped it, or unmapped while
still in use, fails the test. Here: maps, unmaps, idle delivery, the warm
reserve, the engine's folder. A rank out of memory, dead or slow:
``test_tp_rank_failures.py``; the host tier and the pipeline stages' sizes:
``test_tp_host_tier.py``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

from kvelastic.tp import board as shm  # noqa: E402
from tests.kv_fixtures import (BLOCKS_PER_GROUP, GROUP_BYTES, RANK_LAYERS, allocate_within,  # noqa: E402
                               cluster, group_bytes, wait_for)  # noqa: F401 (cluster: a fixture)


@pytest.mark.parametrize("split", RANK_LAYERS)
def test_blocks_are_handed_out_only_once_every_rank_mapped_them(cluster, split):
    layers = RANK_LAYERS[split]
    c = cluster(layers=layers)
    assert c.allocate(3 * BLOCKS_PER_GROUP) is None  # nothing confirmed yet: a scheduling miss
    assert c.mapper.pending_commands, "the miss must turn into map commands for the next step"
    blocks = allocate_within(c, 3 * BLOCKS_PER_GROUP)
    groups = {c.cache.group_of_block(b.block_id) for b in blocks}
    for board in c.mapper.boards:
        assert all(board.groups[g] > 0 for g in groups)
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


def test_commands_reach_idle_ranks_without_a_step_but_never_overtake_one(cluster):
    c = cluster()
    blocks = allocate_within(c, 2 * BLOCKS_PER_GROUP)
    plan = c.mapper.take_plan()  # a step is sent but the ranks have not run it yet
    c.bp.free_blocks(blocks)
    c.queue.set_idle()
    assert not c.mapper.deliver_idle(), "an unmap must wait while a step that may use the group is in flight"
    for conn in c.conns:
        conn.send((plan, [(b.block_id, 1) for b in blocks], []))
    for conn in c.conns:
        assert conn.recv()[0] == "ok"
    c.queue.set_idle()  # the reclaimer's next tick: groups mapped ahead by that step are surplus too
    assert c.mapper.deliver_idle()
    assert wait_for(lambda: all(b.get(shm.HELD_BYTES) <= GROUP_BYTES for b in c.mapper.boards)), \
        "idle ranks kept their pages (mapped, or warm in their reserve)"


def test_ranks_keep_the_warm_reserve_the_reclaimer_asks_for(cluster):
    c = cluster()
    c.step()  # the null group and one group mapped ahead
    baseline = [b.get(shm.HELD_BYTES) for b in c.mapper.boards]
    pages = 2 * GROUP_BYTES // c.cache.pool.page_bytes
    c.cache.pool.grow_reserve(pages)
    assert c.cache.pool.stats().reserve_bytes == 2 * GROUP_BYTES
    c.step()
    assert wait_for(lambda: [b.get(shm.HELD_BYTES) for b in c.mapper.boards]
                    == [v + 2 * GROUP_BYTES for v in baseline]), "the ranks did not build the warm reserve"
    c.cache.pool.trim_reserve(0)
    c.step()
    assert [b.get(shm.HELD_BYTES) for b in c.mapper.boards] == baseline


def test_the_engine_folder_is_unique_to_the_process_not_just_its_pid(tmp_path):
    from kvelastic.cluster.liveness import process_start_time

    from kvelastic.cluster.liveness import own_pid_namespace

    here = shm.engine_dir(os.getpid(), tmp_path)
    assert here == shm.engine_dir(os.getpid(), tmp_path)
    assert here.parent == tmp_path / f"kvelastic-u{os.geteuid()}"  # this user's folder: nobody else writes there
    assert here.name == f"engine-{own_pid_namespace()}-{os.getpid()}-{process_start_time()}"
    assert process_start_time() > 0  # Linux: a reused pid would carry another start time


def test_groups_mapped_for_waiting_requests_are_not_released_before_they_are_used(cluster):
    c = cluster()
    c.queue.want_blocks(4 * BLOCKS_PER_GROUP)  # a waiting request needs four groups more
    c.step()
    c.allocate(2)  # a small allocation (a decoding request) first: the queue re-sizes its prefetch
    assert c.bp.get_num_free_blocks() >= 4 * BLOCKS_PER_GROUP, "groups mapped for the request were released"
    assert c.allocate(4 * BLOCKS_PER_GROUP) is not None
