"""Round trips through BlockCopier that the CPU and GPU test files both run."""

from __future__ import annotations

import random

import torch

from kvelastic.offload.copier import BlockCopier


def strided_views(raw: torch.Tensor, num_blocks: int, widths: list[int], stride: int) -> list[torch.Tensor]:
    """Views like offload_setup.block_views: one run per width inside each block's stride."""
    views, offset = [], 0
    for width in widths:
        views.append(torch.as_strided(raw, (num_blocks, width), (stride, 1), offset))
        offset += width
    return views


def round_trip(device: str, path: str, widths: list[int], *, staging_bytes: int | None = None,
               seed: int = 0) -> BlockCopier:
    """Store random blocks to shuffled slots, load them into other blocks: every byte must match.

    ``staging_bytes``: the copies take the ways that run beside compute (write-through's stores on their
    own stream, loads nothing waits for), each through a staging buffer of that many bytes; else the
    copier's own mover (``path``)."""
    rng = random.Random(seed)
    num_blocks, stride, slots = 64, sum(widths) + 24, 48
    raw = torch.randint(-128, 127, (num_blocks * stride,), dtype=torch.int8, device=device)
    views = strided_views(raw, num_blocks, widths, stride)
    host = torch.zeros((slots, sum(widths)), dtype=torch.int8, pin_memory=device == "cuda")
    staged = staging_bytes is not None
    extra = {"staging_bytes": staging_bytes} if staged else {}
    copier = BlockCopier(views, host, path=path,  # type: ignore[arg-type]
                         staged_side_stores=staged, staged_loads=staged, **extra)
    sources = rng.sample(range(num_blocks), 40)
    targets = rng.sample(range(slots), 40)
    expected = {s: torch.cat([v[s] for v in views]).cpu() for s in sources}
    (copier.store_beside if staged else copier.store)(sources, targets).wait()
    for block, slot in zip(sources, targets):
        assert torch.equal(host[slot], expected[block]), f"slot {slot} differs from block {block}"
    before = raw.clone()
    destinations = rng.sample(range(num_blocks), 40)
    order = list(range(40))
    rng.shuffle(order)
    copier.load([destinations[i] for i in order], [targets[i] for i in order], block_compute=not staged).wait()
    if device == "cuda":
        torch.cuda.synchronize()
    moved = dict(zip(destinations, sources))
    for block in range(num_blocks):
        got = torch.cat([v[block] for v in views]).cpu()
        want = expected[moved[block]] if block in moved else torch.cat([v[block] for v in
                                                                        strided_views(before, num_blocks, widths, stride)]).cpu()
        assert torch.equal(got, want), f"block {block} wrong after load"
    gaps = [raw.view(num_blocks, stride)[:, sum(widths):], before.view(num_blocks, stride)[:, sum(widths):]]
    assert torch.equal(*gaps), "bytes between blocks' runs were written"
    return copier
