"""The host tier's memory pinned in the background on a real GPU: quick to construct, exact copies.

Registers sub-ranges of one buffer with ``cuMemHostRegister``; the copiers'
views of that buffer (the direct path's device view of its base pointer) must
work over every registered chunk, and the staged path's DMA runs must end
where a chunk begins (the driver refuses a copy across two registrations).
"""

from __future__ import annotations

import time

import pytest
import torch

from kvelastic.offload.copier import BlockCopier
from kvelastic.offload.host_memory import CudaPinner, HostMemory, chunk_plan
from kvelastic.offload.host_tier import HostTier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
GIB = 1024 ** 3
SLOT = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def pinned_2gib():
    slots = 2 * GIB // SLOT
    start = time.perf_counter()
    sync = torch.empty((slots, SLOT), dtype=torch.int8, pin_memory=True)
    sync_s = time.perf_counter() - start
    del sync
    torch._C._host_emptyCache()
    start = time.perf_counter()
    memory = HostMemory(slots, SLOT, pinner=CudaPinner())
    constructor_s = time.perf_counter() - start
    assert memory.wait(120) and memory.failure is None
    yield memory, constructor_s, sync_s
    memory.free()


def test_constructor_returns_long_before_a_synchronous_pin(pinned_2gib):
    memory, constructor_s, sync_s = pinned_2gib
    assert constructor_s < 0.25 * sync_s, f"constructor {constructor_s:.3f} s vs synchronous pin {sync_s:.3f} s"
    assert memory.ready_slots == memory.slots and memory.buffer.is_pinned()


@pytest.mark.parametrize("path, staged", [("direct", False), ("runs", False), ("direct", True)])
@pytest.mark.parametrize("where", ["last", "across"])
def test_copies_into_background_pinned_slots_round_trip(pinned_2gib, path, staged, where):
    """Every mover, the staged ones (DMA per run of slots, which must end at each pinned chunk) too."""
    memory = pinned_2gib[0]
    boundary = chunk_plan(memory.slots, SLOT)[1][1]
    slots = list(range(memory.slots - 8, memory.slots)) if where == "last" else list(range(boundary - 4, boundary + 4))
    kv = torch.randint(-128, 127, (32, SLOT), dtype=torch.int8, device="cuda")
    copier = BlockCopier([kv], memory.buffer, path=path, breaks=memory.breaks, staged_side_stores=staged,
                         staged_loads=staged)
    (copier.store_beside if staged else copier.store)(list(range(8)), slots).wait()
    assert torch.equal(memory.buffer[slots], kv[:8].cpu())
    copier.load(list(range(24, 32)), slots, block_compute=not staged).wait()
    torch.cuda.synchronize()
    assert torch.equal(kv[24:], kv[:8])


def test_tier_grows_to_every_slot_on_the_device():
    tier = HostTier(256 * SLOT, SLOT, pin=True)
    try:
        assert tier.memory is not None and tier.memory.wait(60)
        tier.admit("x")
        assert tier.stats().slots == 256 and tier.buffer is not None and tier.buffer.is_pinned()
    finally:
        tier.memory.free()
