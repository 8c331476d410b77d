"""Write-through's stores on a stream of their own, wherever the copier has one (the cache in process).

With one copy stream every copy is ordered after the stores before it; with the stores beside it,
nothing is, so each race must be a wait of its own: a copy-stream batch waits for a store that still
reads a block it writes, or still writes a slot it reads or writes; and compute that reuses a block a
store still reads waits for the side stream too, even in a step whose loads made it wait for the copy
stream. The copier is recorded at its boundary (its streams); the CPU copies are real and synchronous.
"""

from __future__ import annotations

import pytest
import torch

from kvelastic.hooks.offload_setup import local_host_tier
from kvelastic.offload.copier import BlockCopier
from kvelastic.offload.host_tier import HostTier
from kvelastic.offload.store_ahead import AheadCopies
from kvelastic.offload.write_through import WriteThrough
from kvelastic.tp.scheduler_side import RemoteCopier
from tests.host_plans import BESIDE_A_CONNECTOR, IN_PROCESS, ON_RANKS
from tests.test_page_aware_block_pool import build
from tests.test_write_through import Gate, Recording, _computed_and_issued, _read, _setup, _stamp, \
    reuse_a_stored_block_and_load

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vllm installed")


class SideRecording(Recording):
    """A recording copier with a side stream: its stores beside return a Gate; waits are recorded."""

    side_stores = True

    def store_beside(self, block_ids, slots):
        self.calls.append(("beside", tuple(block_ids)))
        self.inner.store(block_ids, slots)
        self.gates.append(Gate(self.stores_done))
        return self.gates[-1]

    def wait_for(self, fences):
        self.calls.append(("wait", tuple(fences)))


def _setup_own(stores_done=False):
    return _setup(stores_done=stores_done, recording_class=SideRecording)


def _names(recording) -> list[str]:
    return [c[0] for c in recording.calls]


def _evict_and_reload(bp, views, manager, blocks, hashes):
    """In one step: every block reused (the evictions promote the copies made ahead), five freed again,
    and the key ``hashes[3]`` looked up: a host hit, loaded into a freed block from its slot."""
    bp.free_blocks(blocks)
    newer = bp.get_new_blocks(len(blocks))
    assert manager.counters.evicted_free == len(blocks)
    for block in newer:
        _stamp(views, block.block_id, 99)
    bp.free_blocks(newer[:5])
    found = bp.get_cached_block(hashes[3], [0])
    manager.end_step()
    return found


def test_stores_go_beside_and_a_reload_racing_one_waits_for_it_first():
    pool, views, bp, manager, copier = _setup_own()
    assert manager.write_through.beside
    blocks, hashes = _computed_and_issued(bp, views, manager, 31, "a")
    assert _names(copier) == ["beside"], "the store went to the side stream"
    found = _evict_and_reload(bp, views, manager, blocks, hashes)  # the store still writes the slot
    assert _names(copier) == ["beside", "wait", "load", "fence"]  # the fence: the reused blocks
    assert copier.calls[1][1] == (copier.gates[0],)
    assert _read(views, found[0].block_id) == [3 % 90 + 1]
    assert manager.stats()["copy_waits"] == 1 and manager.counters.store_fences == 1
    pool.close()


def test_a_step_that_loads_still_fences_compute_for_a_reused_block_a_side_store_reads():
    """With one stream the loads' wait covers the stores (test_write_through); beside, it does not."""
    pool, views, bp, manager, copier = _setup_own()
    reuse_a_stored_block_and_load(bp, views, manager)
    names = _names(copier)
    assert "load" in names and "fence" in names and manager.counters.store_fences == 1
    pool.close()


class ThroughSideMover(SideRecording):
    """The real copier's own :meth:`store_beside` (its staging mover, as the plan in process has it)."""

    def store_beside(self, block_ids, slots):
        self.calls.append(("beside", tuple(block_ids)))
        return self.inner.store_beside(block_ids, slots)


def test_blocks_stored_through_the_side_staging_come_back_exact_after_eviction():
    pool, views, bp, manager, copier = _setup(recording_class=ThroughSideMover)
    assert copier.inner._side_mover is not None and manager.write_through.beside
    blocks, hashes = _computed_and_issued(bp, views, manager, 31, "a")
    assert _names(copier) == ["beside"] and manager.counters.stored_ahead_blocks == 31
    found = _evict_and_reload(bp, views, manager, blocks, hashes)  # evictions free: the copies made ahead
    assert "store" not in _names(copier)
    assert _read(views, found[0].block_id) == [3 % 90 + 1]
    pool.close()


def test_copies_that_race_no_store_do_not_wait():
    pool, views, bp, manager, copier = _setup_own(stores_done=True)
    blocks, hashes = _computed_and_issued(bp, views, manager, 31, "a")
    found = _evict_and_reload(bp, views, manager, blocks, hashes)  # the same step, the stores done
    assert _names(copier) == ["beside", "load"]
    assert _read(views, found[0].block_id) == [3 % 90 + 1]
    pool.close()


def test_stores_touching_names_the_stores_a_copy_would_race_until_they_pass():
    tier = HostTier(64 * 1024, 1024, pin=False, ahead_slots=16)
    wt = WriteThrough(AheadCopies(tier), 1024, beside=True)
    first, second = Gate(False), Gate(False)
    wt.issued([1, 2], [10, 11], first)
    wt.issued([3], [12], second)
    assert wt.stores_touching([2], []) == [first]  # a load into a block a store reads
    assert wt.stores_touching([], [12]) == [second]  # a copy of a slot a store writes
    assert wt.stores_touching([5], [13]) == []
    assert set(map(id, wt.stores_touching([1], [12]))) == {id(first), id(second)}
    first.done = True
    assert wt.stores_touching([1], [10]) == [] and wt.stores_touching([3], []) == [second]


def test_the_stores_go_beside_wherever_the_plan_has_them_and_the_copier_has_a_second_stream():
    assert BlockCopier.side_stores and not RemoteCopier.side_stores  # a TP rank's copies share its one stream
    assert IN_PROCESS.stores_beside and not ON_RANKS.write_through
    pool, _, _, manager, _ = _setup_own()
    assert manager.write_through.beside and manager.copier.side_stores
    pool.close()
    pool, _, _, manager, _ = _setup()  # a copier of one stream: the stores share it
    assert not manager.write_through.beside and manager.copier.side_stores is False
    pool.close()


@pytest.mark.parametrize("path", ["direct", "runs"])
def test_stores_beside_through_a_staging_buffer_of_their_own_land_in_their_slots(path):
    """The side stores' staging: scattered blocks into scattered and consecutive slots, more
    of them than the side staging holds at once (so in several chunks), byte for byte; the copier's own
    mover (``path``) is not the one that moved them."""
    rows, width = 100, 64 * 1024  # 32 MiB of side staging holds 170 rows of 192 KiB: 300 stores, two chunks
    views = [torch.randint(-128, 127, (rows, width), dtype=torch.int8),
             torch.randint(-128, 127, (rows, 2 * width), dtype=torch.int8)]
    host = torch.zeros((300, 3 * width), dtype=torch.int8)
    copier = BlockCopier(views, host, path=path, staged_side_stores=True)
    assert copier._side_mover.rows_per_chunk == 170
    blocks = [(7 * i) % rows for i in range(300)]
    slots = list(range(0, 300, 2)) + list(range(299, 0, -2))
    copier.mover = None  # any use of the main mover would fail
    assert copier.store_beside(blocks, slots).is_done()
    for block, slot in zip(blocks, slots):
        assert torch.equal(host[slot], torch.cat([views[0][block], views[1][block]]))


def test_asynchronous_loads_go_through_a_staging_buffer_of_their_own_and_the_others_do_not():
    """The loads' staging: ``load(block_compute=False)`` through the loads' own staging
    mover, byte for byte over several chunks; a load compute waits for through the copier's own mover."""
    rows, width = 300, 64 * 1024
    views = [torch.zeros((rows, width), dtype=torch.int8), torch.zeros((rows, 2 * width), dtype=torch.int8)]
    host = torch.randint(-128, 127, (rows, 3 * width), dtype=torch.int8)
    copier = BlockCopier(views, host, path="direct", staged_loads=True)
    main, copier.mover = copier.mover, None  # any use of the copier's own mover would fail
    targets, slots = [(7 * i) % rows for i in range(rows)], [(11 * i + 3) % rows for i in range(rows)]
    assert copier.load(targets, slots, block_compute=False).is_done()
    for block, slot in zip(targets, slots):
        assert torch.equal(torch.cat([views[0][block], views[1][block]]), host[slot])
    copier.mover, copier._async_load_mover = main, None  # and now any use of the loads' own would fail
    host[5].fill_(9)
    copier.load([0], [5])
    assert bool((views[0][0] == 9).all())


@pytest.mark.parametrize("plan, staged", [(IN_PROCESS, True), (BESIDE_A_CONNECTOR, True), (ON_RANKS, False)],
                         ids=["in-process", "beside-a-connector", "on-ranks"])
def test_the_staging_buffers_are_allocated_as_the_plan_has_them(kv_log, plan, staged):
    """In process: the side stores' and the loads' (beside a connector too: a long run's pieces go out
    before the step's end, nothing waiting for them); the plan on ranks stores at eviction and stages
    nothing. No line says a setting has no effect: there is none."""
    pool, views, cache, bp, queue = build(limit_groups=1)
    tier, copier = local_host_tier(cache, 1 << 20, "arc", plan)
    assert (copier._side_mover is not None) == staged and (copier._async_load_mover is not None) == staged
    assert (tier.ahead_slots > 0) == plan.write_through
    assert not [r for r in kv_log.records if "no effect" in r.message]
    pool.close()


def test_a_staging_buffer_the_device_refuses_leaves_those_copies_on_the_copiers_path(monkeypatch, kv_log):
    """Out of GPU memory for the 32 MiB buffer (the device's answer, simulated at its boundary): the copier
    is built all the same, its side stores and asynchronous loads take its own path, and the log says so."""
    def refuse(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")

    monkeypatch.setattr("kvelastic.offload.copier.StagedCopy", refuse)
    views = [torch.arange(8 * 64, dtype=torch.int64).view(8, 64).to(torch.int8)]
    host = torch.zeros((8, 64), dtype=torch.int8)
    copier = BlockCopier(views, host, path="direct", staged_side_stores=True, staged_loads=True)
    assert copier._side_mover is None and copier._async_load_mover is None
    copier.store_beside([2, 5], [0, 1])
    assert torch.equal(host[0], views[0][2]) and torch.equal(host[1], views[0][5])
    said = {r.message for r in kv_log.records if "for the staged" in r.message}
    assert len(said) == 2 and all("copier's own path" in m and "Tried to allocate 32.00 MiB" in m for m in said)


def test_a_store_beside_on_a_cpu_copies_at_once():
    views = [torch.arange(8 * 64, dtype=torch.int64).view(8, 64).to(torch.int8)]
    host = torch.zeros((8, 64), dtype=torch.int8)
    copier = BlockCopier(views, host, path="direct")
    assert copier.store_beside([2, 5], [0, 1]).is_done()
    assert torch.equal(host[0], views[0][2]) and torch.equal(host[1], views[0][5])
