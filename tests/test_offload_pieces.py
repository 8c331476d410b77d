"""A long run of host hits is loaded a page group at a time as vLLM looks it up (``OffloadManager.load_on_miss``).

What must hold, whatever the pieces: every block's data comes back exactly; on
the copy stream each piece's spills go before its loads; the pieces issued
early do not fence compute one by one, and the step's compute waits for all of
them (the last batch's fence, or one of its own when no batch is left at the
step's end); where mapping is not synchronous (ranks in other processes) the
step's loads still go out as one batch at its end.
"""

from __future__ import annotations

import types

import pytest
import torch

from kvelastic.hooks.offload_setup import local_host_tier, wire_offload
from kvelastic.offload.host_tier import HostTier
from kvelastic.offload.manager import OffloadManager
from kvelastic.pool.backend import DoneFence
from tests.host_plans import BESIDE_A_CONNECTOR, ON_RANKS
from tests.kv_fixtures import BLOCKS_PER_GROUP
from tests.scheduler_harness import scheduler_patcher
from tests.test_page_aware_block_pool import BS, StandInRequest, build

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")


class Recording:
    """Wraps a copier: records each call as (what, block ids, slots, block_compute) and passes it on."""

    side_stores = False  # one stream

    def __init__(self, inner=None):
        self.inner = inner
        self.calls: list[tuple] = []
        self.bytes_per_block = getattr(inner, "bytes_per_block", 1)

    def store(self, ids, slots, *, block_compute=False):
        self.calls.append(("store", list(ids), list(slots), block_compute))
        return self.inner.store(ids, slots, block_compute=block_compute) if self.inner else DoneFence()

    def load(self, ids, slots, *, block_compute=True):
        self.calls.append(("load", list(ids), list(slots), block_compute))
        return self.inner.load(ids, slots, block_compute=block_compute) if self.inner else DoneFence()

    def fence_compute(self):
        self.calls.append(("fence",))
        if self.inner:
            self.inner.fence_compute()

    def copy_times(self):
        return None


def _stamp(views, block_id: int, value: int) -> None:
    for view in views:
        view[:, block_id].fill_(value)


def _values(views, block_id: int) -> set[int]:
    return {int(v) for view in views for v in view[:, block_id].unique()}


@pytest.mark.parametrize("plan", [BESIDE_A_CONNECTOR, ON_RANKS], ids=["pieces", "one-batch"])
def test_a_long_host_hit_comes_back_exactly_in_pieces_of_a_group_each_fenced_at_the_end(plan):
    """With the cache in process (hits loaded in front of the step, as beside a vLLM connector) the first
    piece goes once the run is two groups long, then a group at a time; without pieces (the plan on ranks,
    whose maps are not synchronous anyway) the same data, all of it in one batch at the step's end."""
    pool, views, cache, bp, queue = build(limit_groups=None)
    tier, copier = local_host_tier(cache, 1 << 24, "arc", plan)
    recording = Recording(copier)
    manager = wire_offload(bp, queue, tier, recording, scheduler_patcher(), plan)
    n = 3 * BLOCKS_PER_GROUP + 5  # a run over four groups, the last one partly
    held = bp.get_new_blocks(BLOCKS_PER_GROUP - 1)  # group 0 (with the null block) stays in use
    blocks = bp.get_new_blocks(n)
    for i, block in enumerate(blocks):
        _stamp(views, block.block_id, i % 100 + 1)
    hashes = [b"k%d" % i for i in range(n)]
    bp.cache_full_blocks(StandInRequest(hashes), blocks, 0, n, BS, 0)
    bp.free_blocks(blocks)
    queue.reclaim_cached(groups_wanted=cache.num_groups)  # spilled (now) and unmapped
    assert manager.counters.spilled_blocks == n
    assert not any(pool.is_mapped(cache.group_of_block(b.block_id)) for b in blocks)
    recording.calls.clear()
    found = [bp.get_cached_block(h, [0])[0] for h in hashes]  # vLLM's lookup, block by block
    early = list(recording.calls)
    manager.flush()  # the step's end
    loads = [c for c in recording.calls if c[0] == "load"]
    if not plan.load_pieces:
        assert early == [] and [len(c[1]) for c in loads] == [n]
    else:
        assert [len(c[1]) for c in loads] == [2 * BLOCKS_PER_GROUP, BLOCKS_PER_GROUP, 5]
        assert all(c[3] is False for c in early) and len(early) == 2  # issued before the end, not fenced one by one
    assert recording.calls[-1][0] == "load" and recording.calls[-1][3] is True  # the last one fences them all
    assert sorted(b for c in loads for b in c[1]) == sorted(b.block_id for b in found)
    for i, block in enumerate(found):
        assert _values(views, block.block_id) == {i % 100 + 1}
    assert manager.counters.reloaded_blocks == n and tier.hits == n
    assert manager.runs.longest() == n  # the run's length is kept (it sizes the reserve for reloads)
    assert manager.stats()["load_runs"] == 1  # one run in front of the step, however many pieces
    bp.free_blocks(held)
    pool.close()


class _Queue:
    """A free queue that hands out ``blocks`` for loads, then none; mapping synchronous or not."""

    def __init__(self, blocks: list, synchronous: bool, per_group: int, victims: list | None = None):
        self.mapper = types.SimpleNamespace(synchronous=synchronous)
        self.cache = types.SimpleNamespace(blocks_per_group=per_group)
        self._blocks = list(blocks)
        self._victims = list(victims or [])
        self.spill_hook = None

    def take_block_for_load(self, protected):
        if not self._blocks:
            return None
        block = self._blocks.pop(0)
        if self._victims and block in self._victims:  # a cached victim: spilled before reuse, as the queue does
            self.spill_hook([block], before_reuse=True)
        return block

    def append(self, block):
        pass


def _manager(blocks, *, synchronous=True, per_group=2, victims=None, pieces=True):
    tier = HostTier(64, 1, pin=False, allocate=False)
    queue = _Queue(blocks, synchronous, per_group, victims)
    recording = Recording()
    manager = OffloadManager(tier, recording, queue, lambda block, key: None, pieces=pieces)
    queue.spill_hook = manager.spill
    return manager, tier, recording


def _block(i: int, key=None):
    return types.SimpleNamespace(block_id=i, block_hash=key)


def test_each_piece_issues_its_spills_before_its_loads():
    victims = [_block(3, "old3"), _block(6, "old6")]
    blocks = [_block(i) for i in range(3)] + [victims[0]] + [_block(i) for i in (4, 5)] + [victims[1], _block(7)]
    manager, tier, recording = _manager(blocks, victims=victims)
    for i in range(8):
        tier.admit(f"k{i}")
    for i in range(8):
        assert manager.load_on_miss(f"k{i}") is blocks[i]
    manager.flush()
    kinds = [(c[0], c[1], c[3]) for c in recording.calls]
    assert kinds == [("store", [3], False), ("load", [0, 1, 2, 3], False), ("load", [4, 5], False),
                     ("store", [6], True), ("load", [6, 7], True)]


def test_a_step_whose_last_lookup_found_no_block_still_fences_the_pieces_issued_early():
    manager, tier, recording = _manager([_block(i) for i in range(4)])
    for i in range(6):
        tier.admit(f"k{i}")
    for i in range(4):
        manager.load_on_miss(f"k{i}")
    assert manager.load_on_miss("k4") is None  # the piece went out, then no block was left for k4
    manager.flush()
    assert [c[0] for c in recording.calls] == ["load", "fence"] and recording.calls[0][3] is False
    manager.flush()  # the next step has nothing to fence
    assert [c[0] for c in recording.calls] == ["load", "fence"]


@pytest.mark.parametrize("synchronous, per_group", [(False, 4), (True, 0)], ids=["ranks-confirm-maps", "no-groups"])
def test_without_synchronous_mapping_the_steps_loads_go_out_as_one_batch_at_its_end(synchronous, per_group):
    manager, tier, recording = _manager([_block(i) for i in range(10)], synchronous=synchronous,
                                        per_group=per_group)
    for i in range(10):
        tier.admit(f"k{i}")
        manager.load_on_miss(f"k{i}")
    assert recording.calls == []
    manager.flush()
    assert [(c[0], len(c[1]), c[3]) for c in recording.calls] == [("load", 10, True)]


def test_torch_tensor_views_keep_their_data_when_loaded_in_pieces_by_the_cpu_copier():
    """The CPU copier moves each piece at once; the union of the pieces is the one batch's data."""
    from kvelastic.offload.copier import BlockCopier

    views = [torch.zeros((12, 8), dtype=torch.int8)]
    host = torch.arange(12 * 8, dtype=torch.int8).view(12, 8)
    copier = BlockCopier(views, host, path="direct")
    for ids, slots in (([0, 1, 2, 3], [11, 10, 9, 8]), ([4, 5], [7, 6])):
        copier.load(ids, slots, block_compute=False)
    copier.fence_compute()
    assert torch.equal(views[0][:6], host[[11, 10, 9, 8, 7, 6]])


def _look_up_runs(manager, tier, lengths, *, between):
    """Runs of host hits of ``lengths`` blocks, each followed by ``between`` (a miss, or a GPU hit)."""
    index = 0
    for length in lengths:
        for _ in range(length):
            tier.admit(f"k{index}")
            assert manager.load_on_miss(f"k{index}") is not None
            index += 1
        if between == "miss":
            assert manager.load_on_miss("not-on-the-host") is None
        else:
            manager.matched(_block(1000 + index))


@pytest.mark.parametrize("between", ["miss", "gpu-hit"])
def test_a_step_of_short_runs_keeps_one_batched_load(between):
    """Three requests' runs of 1.5 groups each, none two groups long: one batch at the step's end."""
    manager, tier, recording = _manager([_block(i) for i in range(18)], per_group=4)
    _look_up_runs(manager, tier, [6, 6, 6], between=between)
    manager.flush()
    assert [len(c[1]) for c in recording.calls if c[0] == "load"] == [18]
    assert manager.runs.longest() == 6


def test_a_long_run_after_short_ones_issues_what_is_pending_once_it_is_long():
    """The first piece carries the step's earlier loads too: they are due anyway, and one stream orders them."""
    manager, tier, recording = _manager([_block(i) for i in range(17)], per_group=4)
    _look_up_runs(manager, tier, [3, 14], between="miss")
    manager.flush()
    assert [(len(c[1]), c[3]) for c in recording.calls if c[0] == "load"] == [(11, False), (4, False), (2, True)]
