"""The block copier on a real GPU: its movers exact over VMM-backed views, and truly asynchronous."""

from __future__ import annotations

import pytest
import torch

from kvelastic.offload.copier import BlockCopier
from kvelastic.pool import PagePool
from tests.copier_cases import round_trip, strided_views

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
MIB = 1024 * 1024


@pytest.mark.parametrize("widths", [[4096, 4096], [1000, 24], [5, 3]], ids=["int64", "int64-odd", "int8"])
def test_round_trip_is_exact_on_the_device(widths):
    round_trip("cuda", "direct", widths)


@pytest.mark.parametrize("widths", [[4096, 4096], [1000, 24], [5, 3]], ids=["int64", "int64-odd", "int8"])
@pytest.mark.parametrize("staging_rows", [1, 7, 1000])
def test_the_staged_movers_round_trip_exactly_on_the_device(widths, staging_rows):
    """Write-through's stores on their own stream and the loads nothing waits for, through staging buffers
    of their own, gathered and scattered by the fused kernel."""
    copier = round_trip("cuda", "direct", widths, staging_bytes=staging_rows * sum(widths))
    assert copier._side_mover.fused is not None and copier._async_load_mover.fused is not None


@pytest.mark.parametrize("piece_kib, path", [(32, "runs"), (16, "direct")])
def test_auto_sends_wide_pieces_to_the_copy_engines_and_keeps_runs_exact(piece_kib, path):
    raw = torch.randint(-128, 127, (128 * 2 * piece_kib * 1024,), dtype=torch.int8, device="cuda")
    views = strided_views(raw, 128, [piece_kib * 1024, piece_kib * 1024], 2 * piece_kib * 1024)
    host = torch.zeros((96, 2 * piece_kib * 1024), dtype=torch.int8, pin_memory=True)
    copier = BlockCopier(views, host, path="auto")
    assert copier.path == path
    want = torch.stack([torch.cat([v[i] for v in views]) for i in range(10, 74)]).cpu()
    copier.store(list(range(10, 74)), list(range(20, 84))).wait()  # one run of 64 blocks
    assert torch.equal(host[20:84], want)
    copier.load(list(range(40, 104)), list(range(20, 84))).wait()
    got = torch.stack([torch.cat([v[i] for v in views]) for i in range(40, 104)]).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_round_trip_over_vmm_pages(staged):
    from kvelastic.pool.cuda import CudaBackend

    pool = PagePool.standard(CudaBackend(), page_bytes=2 * MIB, zero_on_map="fresh")
    try:
        raws = [pool.add_tensor(256 * 64 * 1024) for _ in range(4)]
        pool.map_groups(range(8))
        views = [v for r in raws for v in strided_views(r, 256, [32 * 1024, 32 * 1024], 64 * 1024)]
        for v in views:
            v.view(torch.float16).normal_()
        host = torch.zeros((64, 8 * 32 * 1024), dtype=torch.int8, pin_memory=True)
        copier = BlockCopier(views, host, path="direct", staged_side_stores=staged, staged_loads=staged,
                             staging_bytes=5 * host.shape[1])
        ids = list(range(3, 67))
        want = torch.stack([torch.cat([v[i] for v in views]) for i in ids]).cpu()
        (copier.store_beside if staged else copier.store)(ids, list(range(63, -1, -1))).wait()
        assert torch.equal(host.flip(0), want)
        copier.load(list(range(100, 164)), list(range(63, -1, -1)), block_compute=not staged).wait()
        got = torch.stack([torch.cat([v[i] for v in views]) for i in range(100, 164)]).cpu()
        assert torch.equal(got, want)
        del views, raws
    finally:
        torch.cuda.synchronize()
        pool.close()


@pytest.mark.parametrize("path", ["direct"])
def test_load_orders_later_compute_and_store_returns_before_the_copy_ends(path):
    """The host thread never waits: store returns an unfinished fence; compute after a load sees the data.
    (``runs`` has its own, in test_run_copy_cuda.py: a warm-up first, and runs of blocks to load.)"""
    blocks = torch.randint(-128, 127, (2048, 512 * 1024), dtype=torch.int8, device="cuda")
    host = torch.zeros((2048, 512 * 1024), dtype=torch.int8, pin_memory=True)
    copier = BlockCopier([blocks], host, path=path)
    torch.cuda.synchronize()
    fence = copier.store(list(range(2048)), list(range(2048)))
    assert not fence.is_done(), "a 1 GiB store finished before store() returned: it blocked the host"
    fence.wait()
    assert torch.equal(host[:16], blocks[:16].cpu()) and torch.equal(host[-16:], blocks[-16:].cpu())
    blocks.zero_()
    copier.load([5], [9])
    total = int(blocks[5].to(torch.int64).sum())  # on the default stream, after the load
    assert total == int(host[9].to(torch.int64).sum())
    times = copier.copy_times()
    assert times is not None and times["store_timed_bytes"] == 2048 * 512 * 1024


@pytest.mark.parametrize("path", ["direct"])
def test_a_store_beside_compute_never_holds_the_default_stream_until_fenced(path):
    """Write-through's contract: ``block_compute=False`` leaves compute free; ``fence_compute`` makes it wait."""
    blocks = torch.randint(-128, 127, (64, 64 * 1024), dtype=torch.int8, device="cuda")
    host = torch.zeros((64, 64 * 1024), dtype=torch.int8, pin_memory=True)
    copier = BlockCopier([blocks], host, path=path)
    default = torch.cuda.default_stream()
    copier.store(list(range(64)), list(range(64)))  # warm-up: first-use allocations (pinned indices, the
    torch.cuda.synchronize()                        # gather's output) may synchronize; serving is past them

    def compute_marker() -> torch.cuda.Event:
        marker = torch.cuda.Event()
        marker.record(default)
        return marker

    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(400_000_000)  # keep the copy stream busy (~0.2-0.3 s): the store queues behind it
    fence = copier.store(list(range(64)), list(range(64)), block_compute=False)
    marker = compute_marker()
    marker.synchronize()  # compute queued after the store runs at once
    assert not fence.is_done(), "compute waited for a store made beside it"
    copier.fence_compute()
    marker = compute_marker()
    marker.synchronize()
    assert fence.is_done(), "after fence_compute, compute ran before the store it must wait for"
    assert torch.equal(host, blocks.cpu())


@pytest.mark.parametrize("path", ["direct"])
def test_the_copiers_own_clock_times_finished_batches_only_and_never_waits(path):
    """GPU seconds per direction from events around each batch: a 1 GiB store unfinished is not counted yet
    (reading the totals does not wait for it); once done, its bytes and a time that fits PCIe are."""
    blocks = torch.randint(-128, 127, (2048, 512 * 1024), dtype=torch.int8, device="cuda")
    host = torch.zeros((2048, 512 * 1024), dtype=torch.int8, pin_memory=True)
    copier = BlockCopier([blocks], host, path=path)
    torch.cuda.synchronize()
    fence = copier.store(list(range(2048)), list(range(2048)))
    early = copier.copy_times()
    assert not fence.is_done() and early["store_timed_bytes"] == 0.0 and early["store_seconds"] == 0.0
    fence.wait()
    copier.load(list(range(64)), list(range(64))).wait()
    times = copier.copy_times()
    assert times["store_timed_bytes"] == 2048 * 512 * 1024 and times["load_timed_bytes"] == 64 * 512 * 1024
    assert 1 << 30 < times["store_timed_bytes"] / times["store_seconds"] < 200e9  # bytes per GPU second
    assert times["load_seconds"] > 0


@pytest.mark.parametrize("path, staged", [("direct", False), ("runs", False), ("direct", True), ("runs", True)])
def test_a_store_beside_leaves_the_copy_stream_free_until_a_copy_waits_for_it(path, staged):
    """Write-through's stores on a stream of their own: a load on the copy stream does not queue behind a
    store on the side stream; one told to wait for it (``wait_for``) reads what it wrote; ``fence_compute``
    covers it. ``staged``: the same through a staging buffer of its own."""
    width = 64 * 1024
    blocks = torch.randint(-128, 127, (4096, 2 * width), dtype=torch.int8, device="cuda")
    views = [blocks[:, :width], blocks[:, width:]]
    host = torch.zeros((4096, 2 * width), dtype=torch.int8, pin_memory=True)
    copier = BlockCopier(views, host, path=path, staged_side_stores=staged)
    assert copier.side_stores
    copier.store_beside(list(range(64)), list(range(64))).wait()  # warm-up: the side stream's first use
    copier.load(list(range(64)), list(range(64))).wait()
    torch.cuda.synchronize()
    with torch.cuda.stream(copier._side_stream):
        torch.cuda._sleep(400_000_000)  # keep the side stream busy: the next store queues behind it
    store = copier.store_beside(list(range(2048)), list(range(2048)))
    load = copier.load([4000], [4000])  # another slot, another block: races nothing
    load.wait()
    assert not store.is_done(), "the load waited for a store on the side stream"
    copier.wait_for([store])
    copier.load([3000], [5]).wait()  # slot 5 is the store's: only after it
    assert store.is_done()
    assert torch.equal(blocks[3000].cpu(), blocks[5].cpu())
    with torch.cuda.stream(copier._side_stream):
        torch.cuda._sleep(400_000_000)
    later = copier.store_beside([7], [7])
    copier.fence_compute()
    marker = torch.cuda.Event()
    marker.record(torch.cuda.default_stream())
    marker.synchronize()
    assert later.is_done(), "fence_compute left compute free of a store on the side stream"


@pytest.mark.parametrize("path", ["direct", "runs"])
def test_an_asynchronous_load_through_its_own_staging_leaves_compute_free_and_lands_exactly(path):
    """``staged_loads``: a load nothing waits for (``block_compute=False``) goes through
    the staging buffer of its own, compute queued after it runs at once, and the blocks get the slots'
    bytes, scattered blocks from scattered slots, over several chunks (256 MiB through 32 MiB)."""
    width = 64 * 1024
    blocks = torch.randint(-128, 127, (4096, 2 * width), dtype=torch.int8, device="cuda")
    views = [blocks[:, :width], blocks[:, width:]]
    host = torch.randint(-128, 127, (4096, 2 * width), dtype=torch.int8).pin_memory()
    copier = BlockCopier(views, host, path=path, staged_loads=True)
    copier.load([1], [1], block_compute=False).wait()  # warm-up: first-use allocations
    torch.cuda.synchronize()
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(400_000_000)  # keep the copy stream busy: the load queues behind it
    targets = [(7 * i) % 4096 for i in range(1024)]
    sources = [(11 * i + 3) % 4096 for i in range(1024)]
    fence = copier.load(targets, sources, block_compute=False)
    marker = torch.cuda.Event()
    marker.record(torch.cuda.default_stream())
    marker.synchronize()
    assert not fence.is_done(), "compute waited for an asynchronous load"
    fence.wait()
    got = blocks[targets].cpu()
    assert torch.equal(got, host[sources])
