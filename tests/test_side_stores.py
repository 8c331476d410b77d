"""Write-through's stores on a stream of their own (``KVELASTIC_CPU_STORE_STREAM=own``).

With one copy stream every copy is ordered after the stores before it; with the stores beside it,
nothing is, so each race must be a wait of its own: a copy-stream batch waits for a store that still
reads a block it writes, or still writes a slot it reads or writes; and compute that reuses a block a
store still reads waits for the side stream too, even in a step whose loads made it wait for the copy
stream. The copier is recorded at its boundary (its streams); the CPU copies are real and synchronous.
"""

from __future__ import annotations

import pytest
import torch

from kvelastic.hooks.offload_setup import local_host_tier, wire_offload
from kvelastic.offload.copier import BlockCopier
from kvelastic.offload.host_tier import HostTier
from kvelastic.offload.side_stores import side_stores_apply
from kvelastic.offload.store_ahead import AheadCopies
from kvelastic.offload.write_through import WriteThrough
from kvelastic.settings import Settings
from kvelastic.tp.scheduler_side import RemoteCopier
from tests.scheduler_harness import scheduler_patcher
from tests.test_page_aware_block_pool import build
from tests.test_write_through import WT, Gate, Recording, _computed_and_issued, _read, _setup, _stamp, \
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
    return _setup(stores_done=stores_done, recording_class=SideRecording, cpu_store_stream="own")


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
    """The real copier's own :meth:`store_beside` (its staging mover with ``KVELASTIC_CPU_STORE_PATH=staged``)."""

    def store_beside(self, block_ids, slots):
        self.calls.append(("beside", tuple(block_ids)))
        return self.inner.store_beside(block_ids, slots)


def test_blocks_stored_through_the_side_staging_come_back_exact_after_eviction():
    pool, views, bp, manager, copier = _setup(recording_class=ThroughSideMover, cpu_store_stream="own",
                                               cpu_store_path="staged")
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
    wt = WriteThrough(AheadCopies(tier), 1 << 20, 1024, beside=True)
    first, second = Gate(False), Gate(False)
    wt.issued([1, 2], [10, 11], first)
    wt.issued([3], [12], second)
    assert wt.stores_touching([2], []) == [first]  # a load into a block a store reads
    assert wt.stores_touching([], [12]) == [second]  # a copy of a slot a store writes
    assert wt.stores_touching([5], [13]) == []
    assert set(map(id, wt.stores_touching([1], [12]))) == {id(first), id(second)}
    first.done = True
    assert wt.stores_touching([1], [10]) == [] and wt.stores_touching([3], []) == [second]


def test_own_stream_applies_only_where_the_copier_has_one():
    host = torch.zeros((8, 64), dtype=torch.int8)
    views = [torch.zeros((8, 64), dtype=torch.int8)]
    direct = BlockCopier(views, host, path="direct")
    staged = BlockCopier(views, host, path="staged")
    assert side_stores_apply(direct, "own") and not side_stores_apply(direct, "shared")
    assert not side_stores_apply(staged, "own")  # its staging buffer would be shared by two streams
    assert side_stores_apply(BlockCopier(views, host, path="staged", side_path="staged"), "own")  # one each
    assert RemoteCopier.side_stores is False  # a TP rank's stores stay on its one stream


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_stores_beside_through_a_staging_buffer_of_their_own_land_in_their_slots(path):
    """``KVELASTIC_CPU_STORE_PATH=staged``: scattered blocks into scattered and consecutive slots, more
    of them than the side staging holds at once (so in several chunks), byte for byte; the copier's own
    mover (``path``) is not the one that moved them."""
    rows, width = 100, 64 * 1024  # 32 MiB of side staging holds 170 rows of 192 KiB: 300 stores, two chunks
    views = [torch.randint(-128, 127, (rows, width), dtype=torch.int8),
             torch.randint(-128, 127, (rows, 2 * width), dtype=torch.int8)]
    host = torch.zeros((300, 3 * width), dtype=torch.int8)
    copier = BlockCopier(views, host, path=path, side_path="staged")
    assert copier.side_stores and copier.side_path == "staged"
    assert copier._side_mover.rows_per_chunk == 170
    blocks = [(7 * i) % rows for i in range(300)]
    slots = list(range(0, 300, 2)) + list(range(299, 0, -2))
    copier.mover = None  # any use of the main mover would fail
    assert copier.store_beside(blocks, slots).is_done()
    for block, slot in zip(blocks, slots):
        assert torch.equal(host[slot], torch.cat([views[0][block], views[1][block]]))


def test_asynchronous_loads_go_through_a_staging_buffer_of_their_own_and_the_others_do_not():
    """``KVELASTIC_CPU_LOAD_PATH=staged``: ``load(block_compute=False)`` through the loads' own staging
    mover, byte for byte over several chunks; a load compute waits for through the copier's own mover."""
    rows, width = 300, 64 * 1024
    views = [torch.zeros((rows, width), dtype=torch.int8), torch.zeros((rows, 2 * width), dtype=torch.int8)]
    host = torch.randint(-128, 127, (rows, 3 * width), dtype=torch.int8)
    copier = BlockCopier(views, host, path="direct", async_load_path="staged")
    main, copier.mover = copier.mover, None  # any use of the copier's own mover would fail
    targets, slots = [(7 * i) % rows for i in range(rows)], [(11 * i + 3) % rows for i in range(rows)]
    assert copier.load(targets, slots, block_compute=False).is_done()
    for block, slot in zip(targets, slots):
        assert torch.equal(torch.cat([views[0][block], views[1][block]]), host[slot])
    copier.mover, copier._async_load_mover = main, None  # and now any use of the loads' own would fail
    host[5].fill_(9)
    copier.load([0], [5])
    assert bool((views[0][0] == 9).all())


@pytest.mark.parametrize("load, asked, path", [("async", "staged", "staged"), ("auto", "staged", "staged"),
                                               ("sync", "staged", "same"), ("sync", "same", "same")])
def test_the_loads_staging_is_allocated_only_with_asynchronous_loads(kv_log, load, asked, path):
    """Said where a value other than the default moves nothing (the default, ``staged``, goes unsaid)."""
    pool, views, cache, bp, queue = build(limit_groups=1)
    settings = Settings(**{**WT, "cpu_load": load, "cpu_load_path": asked})
    tier, copier = local_host_tier(cache, settings)
    assert copier.async_load_path == path and (copier._async_load_mover is not None) == (path == "staged")
    said = sorted({r.message for r in kv_log.records if "KVELASTIC_CPU_LOAD_PATH=" in r.message})
    assert said == ([f"kvelastic: KVELASTIC_CPU_LOAD_PATH={asked} has no effect here: it moves the asynchronous "
                     "loads, and KVELASTIC_CPU_LOAD is sync"] if (load, asked) == ("sync", "same") else [])
    pool.close()


def test_a_staging_buffer_the_device_refuses_leaves_those_copies_on_the_copiers_path(monkeypatch, kv_log):
    """Out of GPU memory for the 32 MiB buffer (the device's answer, simulated at its boundary): the copier
    is built all the same, its side stores and asynchronous loads take its own path, and the log says so."""
    def refuse(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")

    monkeypatch.setattr("kvelastic.offload.copier.StagedCopy", refuse)
    views = [torch.arange(8 * 64, dtype=torch.int64).view(8, 64).to(torch.int8)]
    host = torch.zeros((8, 64), dtype=torch.int8)
    copier = BlockCopier(views, host, path="direct", side_path="staged", async_load_path="staged")
    assert copier._side_mover is None and copier._async_load_mover is None
    copier.store_beside([2, 5], [0, 1])
    assert torch.equal(host[0], views[0][2]) and torch.equal(host[1], views[0][5])
    said = {r.message for r in kv_log.records if "for the staged" in r.message}
    assert len(said) == 2 and all("copier's own path" in m and "Tried to allocate 32.00 MiB" in m for m in said)


def test_an_unknown_side_path_is_refused():
    views = [torch.zeros((8, 64), dtype=torch.int8)]
    with pytest.raises(ValueError, match="side path 'engines'"):
        BlockCopier(views, torch.zeros((8, 64), dtype=torch.int8), side_path="engines")


@pytest.mark.parametrize("store, stream, side_path", [("write-through", "own", "staged"),
                                                      ("write-through", "shared", "same"),
                                                      ("eviction", "own", "same")])
def test_the_side_staging_is_allocated_only_where_stores_run_on_their_own_stream(store, stream, side_path):
    pool, views, cache, bp, queue = build(limit_groups=1)
    settings = Settings(**{**WT, "cpu_store": store, "cpu_store_stream": stream, "cpu_store_path": "staged"})
    tier, copier = local_host_tier(cache, settings)
    assert copier.side_path == side_path and (copier._side_mover is not None) == (side_path == "staged")
    pool.close()


def test_a_store_beside_on_a_cpu_copies_at_once():
    views = [torch.arange(8 * 64, dtype=torch.int64).view(8, 64).to(torch.int8)]
    host = torch.zeros((8, 64), dtype=torch.int8)
    copier = BlockCopier(views, host, path="direct")
    assert copier.store_beside([2, 5], [0, 1]).is_done()
    assert torch.equal(host[0], views[0][2]) and torch.equal(host[1], views[0][5])


@pytest.mark.parametrize("store, stream, path, said", [
    ("eviction", "shared", "direct", "KVELASTIC_CPU_STORE_STREAM=shared has no effect here: it moves write-through's "
                                     "stores, and KVELASTIC_CPU_STORE is not write-through"),
    ("eviction", "own", "direct", None),  # the defaults, where they move nothing: unsaid
    ("write-through", "own", "staged", "write-through's stores share the copy stream: the copier has no second "
                                       "stream to give")])
def test_own_stream_where_it_cannot_apply_says_so_and_keeps_one_stream(kv_log, store, stream, path, said):
    """``KVELASTIC_COPY_PATH=staged`` with the stores' path ``same``: no staging buffer for a second stream."""
    pool, views, cache, bp, queue = build(limit_groups=1)
    settings = Settings(**{**WT, "cpu_store": store, "cpu_store_stream": stream, "copy_path": path,
                           "cpu_store_path": "same" if path == "staged" else "staged"})
    tier, copier = local_host_tier(cache, settings)
    manager = wire_offload(bp, queue, tier, copier, scheduler_patcher(), settings)
    assert manager.copier is copier and (manager.write_through is None or not manager.write_through.beside)
    messages = sorted({r.message for r in kv_log.records if "STORE_STREAM=" in r.message or "copy stream" in r.message})
    assert len(messages) == (said is not None) and all(said in m for m in messages)
    pool.close()


def test_a_store_path_without_its_own_stream_says_so(kv_log):
    pool, views, cache, bp, queue = build(limit_groups=1)
    settings = Settings(**{**WT, "cpu_store_stream": "shared", "cpu_store_path": "same"})
    tier, copier = local_host_tier(cache, settings)
    manager = wire_offload(bp, queue, tier, copier, scheduler_patcher(), settings)
    assert not manager.write_through.beside
    assert [r.message for r in kv_log.records if "KVELASTIC_CPU_STORE_PATH=same has no effect" in r.message
            and "KVELASTIC_CPU_STORE_STREAM is not own" in r.message]
    assert not any("KVELASTIC_CPU_STORE_STREAM=" in r.message for r in kv_log.records)  # it applies: unsaid
    pool.close()
