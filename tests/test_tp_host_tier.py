"""The host tier under the TP protocol: spills and reloads on every rank's shard.

Two rank processes with host-backed pools and the real scheduler side, as in
``test_tp_protocol.py`` (the harness: ``tests/tp_cluster.py``). A slot of the
scheduler's index is one slot on every rank, each holding its own shard; under
pipeline parallelism a slot holds every stage's share and a group counts at the
larger stage's bytes.
"""

from __future__ import annotations

import hashlib
import time

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

from tests.kv_fixtures import BLOCKS_PER_GROUP, BS, RANK_LAYERS, StandInRequest, group_bytes  # noqa: E402
from tests.scheduler_harness import scheduler_patcher  # noqa: E402
from tests.tp_cluster import allocate_within, cluster  # noqa: E402,F401 (cluster: a fixture)

CPU_BYTES = 1 << 20


def test_pipeline_stages_count_each_group_at_the_larger_stage_and_a_slot_holds_both_shares(cluster):
    layers = RANK_LAYERS["pipeline"]
    c = cluster(cpu_bytes=CPU_BYTES, layers=layers)
    assert c.cache.group_bytes == group_bytes(max(layers))
    infos = c.infos
    assert [i.group_bytes for i in infos] == [group_bytes(n) for n in layers]
    assert c.connection.slot_bytes == sum(i.slot_bytes for i in infos)
    assert c.connection.host_slots == min(i.host_slots for i in infos) > 0


def every_slot_reported_pinned(c, tier) -> bool:
    """Run steps until every rank reported its whole host share pinned and the tier took it in (the scheduler
    asks for a report step every ``PIN_REPORT_PERIOD_S`` while a rank pins)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c.step()
        tier.refresh()
        if tier.stats().slots == c.connection.host_slots > 0:
            return True
        time.sleep(0.02)
    return False


def test_spilled_blocks_come_back_on_every_rank(cluster):
    from kvelastic.hooks.offload_setup import wire_offload
    from kvelastic.settings import Settings
    from tests.host_plans import ON_RANKS

    c = cluster(cpu_bytes=CPU_BYTES)
    tier, copier = c.connection.host_tier(Settings(cpu_bytes=CPU_BYTES), ON_RANKS)
    manager = wire_offload(c.bp, c.queue, tier, copier, scheduler_patcher(), ON_RANKS)
    assert every_slot_reported_pinned(c, manager.tier)
    allocate_within(c, BLOCKS_PER_GROUP - 1)  # fills the null block's group, which is never released
    blocks = allocate_within(c, BLOCKS_PER_GROUP)
    c.step(writes=[(b.block_id, 40 + i % 50) for i, b in enumerate(blocks)])
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(len(blocks))]
    c.bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, len(blocks), BS, 0)
    c.bp.free_blocks(blocks)
    assert c.queue.reclaim_cached(groups_wanted=8) >= 1  # spill, then unmap, in that order on each rank
    c.queue.set_idle()
    report = c.step(report=True)
    assert manager.counters.spilled_blocks == len(blocks)
    assert [r.mapped_bytes for r in sorted(report.ranks, key=lambda r: r.rank)] == c.mapped_bytes
    c.queue.want_blocks(len(blocks))  # free mapped blocks to load into
    c.step()
    found = [c.bp.get_cached_block(h, [0]) for h in hashes]  # host-tier hits become GPU blocks
    assert all(f is not None for f in found)
    manager.flush()
    new_ids = [f[0].block_id for f in found]
    assert len(set(new_ids)) == len(new_ids)
    steps = 0
    while not all(c.cache.group_of_block(b) in c.mapper.mapped_groups for b in new_ids) and steps < 5:
        c.step()
        steps += 1
    c.step(checks=[(b, 40 + i % 50) for i, b in enumerate(new_ids)])
    assert manager.counters.reloaded_blocks == len(blocks)
