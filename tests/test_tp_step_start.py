"""The ranks' start-up state and pinned host slots, as the scheduler learns them without any shared file.

What the scheduler knows of the ranks before the first step comes from their descriptions
(sent back over vLLM's ``collective_rpc``), and how far each has pinned its host-tier share only
from the reports on the steps' replies. The guarantees checked: a block comes only from a group
every rank mapped; a host slot is handed out only once every rank reported it pinned; the
scheduler numbers its commands on from the highest mark any rank applied.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")

from kvelastic.settings import Settings  # noqa: E402
from kvelastic.tp import remote_mapper, start_state  # noqa: E402
from kvelastic.tp.host_supply import ReportedHostSupply  # noqa: E402
from kvelastic.tp.protocol import MAP, START_SEQ, UNMAP  # noqa: E402
from kvelastic.tp.rank_info import decode_info  # noqa: E402
from kvelastic.tp.remote_mapper import PIN_REPORT_PERIOD_S, RemoteMapper  # noqa: E402
from kvelastic.tp.step_report import RankReport, StepReport  # noqa: E402
from tests.kv_fixtures import BLOCKS_PER_GROUP, WORLD, build_cache  # noqa: E402
from tests.tp_cluster import allocate_within, cluster  # noqa: E402,F401 (cluster: a fixture)

#: Groups each rank maps before it serves (besides the null group 0): 1 and 3 on both, 2 on rank 0 only.
START_GROUPS = ((1, 2, 3), (1, 3))
#: The same before a scheduler with vLLM's block pool, whose queue keeps at most two empty groups mapped
#: ahead (it would give group 3 back at once): group 1 on both ranks, group 2 on rank 0 only.
QUEUED_START_GROUPS = ((1, 2), (1,))


def _ranks_in_this_process(start_groups):
    """Two rank workers over host-backed caches, each having mapped its ``start_groups``."""
    from kvelastic.tp.worker_side import start_rank

    made = []
    for rank, groups in enumerate(start_groups):
        pool, _, cache = build_cache()
        cache.map_groups(groups)
        made.append((pool, start_rank(cache, rank, WORLD, None, None)))
    return made


def test_the_descriptions_give_the_start_every_rank_shares():
    """Adopted: what every rank mapped (the null group included); unmapped first: what only some did; the mark
    to number on from. The description a rank sends back carries its groups and mark as described."""
    from kvelastic.tp import rank_handover

    made = _ranks_in_this_process(START_GROUPS)
    try:
        infos = [worker.info for _, worker in made]
        assert start_state.of_descriptions(infos) == start_state.StartState(adopted=(0, 1, 3), partial=(2,),
                                                                            applied=START_SEQ)
        sent = decode_info(rank_handover.describe(None), "the description sent back")  # the last rank's
        assert sent.start_groups == (0, 1, 3) and sent.applied == 0
    finally:
        for pool, worker in made:
            worker.close()
            pool.close()
        rank_handover.forget()


def test_groups_a_warm_up_maps_after_the_cache_was_published_are_in_the_description_and_adopted():
    """vLLM 0.34's kernel warm-up maps the groups of its blocks (``warmup_blocks``) after each rank published
    its cache and started serving its scheduler; the engine core asks for the descriptions only after the
    warm-up: they carry those groups, so the scheduler adopts them (and later releases them) rather than
    leave them mapped on the ranks behind its back."""
    from kvelastic.tp import rank_handover
    from kvelastic.worker.extensible import map_warmup_blocks

    made = _ranks_in_this_process(((1,), (1,)))
    try:
        for _, worker in made:  # the warm-up, after start_rank: blocks [0, 4 groups)
            map_warmup_blocks(worker.cache, 4 * BLOCKS_PER_GROUP)
        infos = [worker.describe() for _, worker in made]
        assert start_state.of_descriptions(infos).adopted == (0, 1, 2, 3)
        sent = decode_info(rank_handover.describe(None), "the description sent back")  # the last rank's
        assert sent.start_groups == (0, 1, 2, 3)
    finally:
        for pool, worker in made:
            worker.close()
            pool.close()
        rank_handover.forget()


def test_commands_are_numbered_on_from_the_highest_mark_any_rank_described():
    from kvelastic.tp.scheduler_side import RankConnection

    made = _ranks_in_this_process(START_GROUPS)
    try:
        infos = [dataclasses.replace(worker.info, applied=mark) for (_, worker), mark in zip(made, (9, 5))]
        connection = RankConnection(infos)
        assert connection.mapper.mapped_groups == {0, 1, 3}
        assert connection.mapper.take_plan().commands == ((10, UNMAP, (2,)),)
    finally:
        for pool, worker in made:
            worker.close()
            pool.close()


def test_the_scheduler_adopts_what_every_rank_mapped_at_start_and_unmaps_the_rest(cluster):
    c = cluster(start_groups=QUEUED_START_GROUPS)
    assert c.mapper.mapped_groups == {0, 1}
    assert c.mapper.pending_commands == 1  # the unmap of group 2: no map yet, so the first step is only that
    report = c.step(report=True)
    held = {r.rank: r.mapped_bytes for r in report.ranks}
    assert held[0] == held[1], f"rank 0 still holds its lone group 2 after the first step: {held}"
    blocks = c.allocate(2 * BLOCKS_PER_GROUP - 1)  # groups 0 and 1 (but the null block), no map needed
    assert blocks is not None, "the groups every rank mapped at start-up were not adopted"
    assert {c.cache.group_of_block(b.block_id) for b in blocks} == {0, 1}
    assert c.allocate(1) is None, "a block of a group not every rank confirmed was handed out"
    more = allocate_within(c, BLOCKS_PER_GROUP)  # mapped anew on both ranks, confirmed by both reports
    c.step(writes=[(b.block_id, 1) for b in blocks + more])  # every rank checks each block it writes is mapped


def test_the_first_command_unmaps_the_group_only_one_rank_mapped(cluster):
    c = cluster(start_groups=QUEUED_START_GROUPS)
    c.queue.want_blocks(5 * BLOCKS_PER_GROUP)
    plan = c.mapper.take_plan()
    assert plan.commands[0] == (START_SEQ + 1, UNMAP, (2,))
    assert all(c[0] > START_SEQ + 1 for c in plan.commands if c[1] == MAP)


def test_host_slots_are_handed_out_only_as_far_as_every_rank_reported_pinned(cluster):
    """Each rank pins its share chunk by chunk. The tier grows to the least count the ranks reported, only
    when a report step brings it: not to what a rank has pinned since, and not
    to the whole share. While a rank still pins, the scheduler asks for report steps itself."""
    c = cluster(host_slots=16)  # each rank: a 1-slot head pinned at start, then chunks of 4
    from tests.host_plans import ON_RANKS

    tier, _ = c.connection.host_tier(Settings(), ON_RANKS)
    assert tier.admit("k0") is None and tier.stats().slots == 0, "a slot was handed out before any report"
    first = c.step()  # the ranks begin pinning at their first step
    assert first is not None, "the scheduler did not ask for a report while the ranks pin"
    assert {r.rank: (r.host_ready, r.host_settled) for r in first.ranks} == {0: (1, False), 1: (1, False)}
    assert tier.admit("k0") == 0 and tier.stats().slots == 1
    assert c.pin(0, 2, 9) == (9, False) and c.pin(1, 1, 5) == (5, False)
    tier.admit("k1")
    assert tier.stats().slots == 1, "the tier grew without a report"
    time.sleep(PIN_REPORT_PERIOD_S)
    report = c.step()
    assert report is not None and {r.rank: r.host_ready for r in report.ranks} == {0: 9, 1: 5}
    slots = [tier.admit(f"k{i}") for i in range(2, 12)]
    assert tier.stats().slots == 5, "the tier must hold what the rank that pinned least reported"
    assert all(slot is None or slot < 5 for slot in slots)
    assert c.pin(0, 2, 16) == (16, True) and c.pin(1, 3, 16) == (16, True)
    time.sleep(PIN_REPORT_PERIOD_S)
    assert c.step() is not None
    tier.admit("last")
    assert tier.stats().slots == 16
    time.sleep(PIN_REPORT_PERIOD_S)
    assert not c.mapper.wants_report and c.step() is None, "report steps went on after every rank settled"


def test_report_steps_come_while_a_rank_pins_and_at_most_every_period(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(remote_mapper.time, "monotonic", lambda: now[0])  # the clock: the one boundary here
    mapper = RemoteMapper(WORLD)
    assert not mapper.take_plan().report, "no host tier, nothing pending: no report step"
    supply = ReportedHostSupply(WORLD)
    mapper.follow_pinning(supply)
    assert mapper.take_plan().report
    assert not mapper.take_plan().report, "a report step on every step while pinning"
    mapper.adopt(StepReport((RankReport(rank=0, applied=0, step=1, host_ready=4),)))
    assert (supply.ready_slots, supply.settled) == (0, False), "rank 1 has not reported: nothing is ready"
    now[0] += PIN_REPORT_PERIOD_S
    assert mapper.take_plan().report
    mapper.adopt(StepReport(tuple(RankReport(rank=r, applied=0, step=2, host_ready=6 - r, host_settled=True)
                                  for r in range(WORLD))))
    assert (supply.ready_slots, supply.settled) == (5, True)
    now[0] += PIN_REPORT_PERIOD_S
    assert not mapper.take_plan().report, "every rank settled: no more report steps for pinning"
