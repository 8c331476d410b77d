"""Host-tier loads that run beside compute: the ledger of what is in flight, per request.

The synchronous path (``manager.OffloadManager.load_on_miss``) makes a host hit
look like a GPU hit, and the step's forward pass waits for the load. Here a
request's run of host-held blocks is loaded while the request waits (vLLM's
``WAITING_FOR_REMOTE_KVS``, reached through kvelastic's scheduler-side connector,
``kvelastic/hooks/host_loads.py``) and other requests compute; the request is
scheduled once the load's fence passed (docs/offload.md, "How a host hit comes back").

What this ledger guarantees, with no vLLM in sight:

* a host slot being read is pinned from the moment the load is planned until
  its fence passed, so the policy never evicts it and no spill overwrites it;
* the destination blocks carry one extra reference (``hold``) for as long, so
  they are never handed to another request, nor their page group released,
  even where vLLM frees an aborted request's blocks at once (0.12-0.15);
* the policy sees one request (a hit) per loaded block, in prefix order, when
  the load is planned, as the synchronous path makes at lookup; looking at a
  request's run (:meth:`host_run`) changes nothing;
* a key already being loaded for one request is never loaded again for
  another: :meth:`host_run` says "ask again later" (None) instead;
* a run offered to vLLM stays on the host until vLLM has allocated its
  blocks: :meth:`promise` pins it for the rest of ``schedule()``, since the
  allocation in between may evict GPU blocks whose spills would otherwise
  push the run out of the tier; should a key be gone all the same, the load
  fails (its blocks are recomputed) instead of stopping the engine;
* a load that could not be issued is reported as failed blocks, which vLLM
  recomputes; its pins and references are given back, and that request is
  offered no host run again (else it would fail and retry forever).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from kvelastic.offload.host_runs import HostRuns
from kvelastic.offload.host_tier import HostTier
from kvelastic.pool.backend import Fence
from kvelastic.roles import Copier


@dataclass
class PlannedLoad:
    """One request's run of host blocks, from planning until its fence passed."""

    request_id: str
    keys: tuple[Hashable, ...]
    blocks: tuple[Any, ...]  # vLLM's block objects (each has ``block_id``)
    slots: tuple[int, ...]
    fence: Fence | None = None  # None until issued
    failed: bool = False

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass
class Retired:
    """What the scheduler learns in one step: async loads done (request ids) and blocks that failed."""

    finished: list[str] = field(default_factory=list)
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass
class LoadCounters:
    async_loads: int = 0
    async_blocks: int = 0
    failed_loads: int = 0
    deferred_lookups: int = 0  # "ask again": the run reached a key another request was loading


class AsyncLoads:
    """Plans, issues and retires host-tier loads for one GPU block pool."""

    def __init__(self, tier: HostTier, copier: Copier, hold: Callable[[Sequence[Any]], None],
                 release: Callable[[Sequence[Any]], None], *, runs: HostRuns | None = None):
        """``hold(blocks)`` / ``release(blocks)``: one more / one less reference on vLLM's blocks
        (``BlockPool.touch`` / ``free_blocks``). ``runs``: where each planned run's length goes (the warm
        reserve for reloads sizes itself from them, as from the synchronous path's)."""
        self.tier = tier
        self.runs = runs
        self.copier = copier
        self._hold = hold
        self._release = release
        self.counters = LoadCounters()
        self._queued: list[PlannedLoad] = []  # planned this step, issued at its end
        self._issued: deque[PlannedLoad] = deque()  # in issue order: one stream completes them in order
        self._loading: dict[Hashable, int] = {}  # key -> loads in flight that read it
        self._refused: set[str] = set()  # requests whose load failed: recomputed, never offered the host again
        self._promised: dict[str, tuple[Hashable, ...]] = {}  # request -> run offered this step, pinned

    # ----------------------------------------------------------- look (no side effect)
    def host_run(self, keys: Sequence[Hashable], request_id: str | None = None) -> int | None:
        """How many of ``keys``, from the first, the host tier holds; None when that run reaches a key
        already being loaded (the caller asks again later, and then finds it on the GPU); 0 for a
        request whose load failed before."""
        if request_id in self._refused:
            return 0
        run = 0
        for key in keys:
            if key in self._loading:
                self.counters.deferred_lookups += 1
                return None
            if key not in self.tier:
                break
            run += 1
        return run

    # ---------------------------------------------------------------- promise
    def promise(self, request_id: str, keys: Sequence[Hashable]) -> None:
        """``keys`` (a run :meth:`host_run` just counted) are offered to ``request_id``: pinned until
        :meth:`plan` takes them or ``schedule()`` ends (:meth:`issue`), replacing what was offered to
        that request before. An empty ``keys`` only withdraws the earlier offer.

        vLLM asks a waiting request's run again at every step it stays waiting, mostly for the same
        run: only the keys that joined or left the offer are pinned or let go, each key's pin count
        never dipping to zero in between."""
        keys = tuple(keys)
        before = self._promised.pop(request_id, ())
        if keys:
            self._promised[request_id] = keys
        if keys == before:
            return
        kept = set(before).intersection(keys)
        for key in keys:
            if key not in kept:
                self.tier.pin(key)
        for key in before:
            if key not in kept:
                self.tier.unpin(key)

    def _withdraw(self, request_id: str) -> None:
        for key in self._promised.pop(request_id, ()):
            self.tier.unpin(key)

    def _withdraw_all(self) -> None:
        for request_id in list(self._promised):
            self._withdraw(request_id)

    # ------------------------------------------------------------------- plan
    def plan(self, request_id: str, keys: Sequence[Hashable], blocks: Sequence[Any]) -> None:
        """Load ``keys`` into ``blocks`` (vLLM just allocated them to ``request_id``): each key is
        requested from the policy (a hit) and pinned, each block held, and the load queued for
        :meth:`issue`. The keys were promised to the request in this step; one that left the tier all
        the same fails the load: its blocks are reported to vLLM, which recomputes them."""
        assert len(keys) == len(blocks) and keys, "internal: a load needs one block per key"
        self._hold(blocks)
        if not all(key in self.tier for key in keys):
            self._withdraw(request_id)
            self.counters.failed_loads += 1
            self._queued.append(PlannedLoad(request_id, (), tuple(blocks), (), failed=True))
            return
        slots = []
        for key in keys:
            slot = self.tier.lookup(key)
            assert slot is not None  # checked above; lookup changes no membership
            self.tier.pin(key)
            self._loading[key] = self._loading.get(key, 0) + 1
            slots.append(slot)
        self._withdraw(request_id)
        self._queued.append(PlannedLoad(request_id, tuple(keys), tuple(blocks), tuple(slots)))
        if self.runs is not None:
            self.runs.record(len(keys))

    # ------------------------------------------------------------------ issue
    def issue(self) -> None:
        """End of ``schedule()``: issue the loads planned in it, beside compute, as one batch whose fence
        every load of it shares: one request's run alone is often a few blocks, which the copy paths move
        well below the link's rate, and the requests of a step are retired together at the next step
        anyway. A batch that cannot be queued fails its loads. Runs offered in this ``schedule()`` and
        not taken are no longer held."""
        self._withdraw_all()
        queued, self._queued = self._queued, []
        batch = [load for load in queued if not load.failed]
        if batch:
            self._issue_batch(batch)
        self._issued.extend(queued)  # a failed one (its keys left the tier before it was planned) retires at once

    def _issue_batch(self, batch: list[PlannedLoad]) -> None:
        block_ids = [block_id for load in batch for block_id in load.block_ids]
        slots = [slot for load in batch for slot in load.slots]
        try:
            fence = self.copier.load(block_ids, slots, block_compute=False)
        except Exception:
            fence = None
            self.counters.failed_loads += len(batch)
        self.counters.async_loads += len(batch)
        self.counters.async_blocks += len(block_ids)
        for load in batch:
            load.fence = fence
            load.failed = fence is None

    # ----------------------------------------------------------------- retire
    def retire(self) -> Retired:
        """The loads whose fences passed (or that failed), in issue order, stopping at the first still
        running: pins and held blocks given back, each reported by request id (vLLM then schedules the
        request); a failed load also names its blocks (vLLM recomputes them)."""
        out = Retired()
        while self._issued:
            load = self._issued[0]
            if not load.failed and load.fence is not None and not load.fence.is_done():
                break
            self._issued.popleft()
            self._finish(load)
            out.finished.append(load.request_id)
            if load.failed:
                out.invalid_block_ids.update(load.block_ids)
                self._refused.add(load.request_id)
        return out

    def wait_all(self) -> Retired:
        """Wait for every load issued (a prefix-cache reset frees host slots): then :meth:`retire`."""
        self._withdraw_all()
        for load in self._issued:
            if load.fence is not None and not load.failed:
                load.fence.wait()
        return self.retire()

    @property
    def in_flight(self) -> bool:
        """A load is planned or issued and not yet retired (the engine must keep stepping)."""
        return bool(self._queued or self._issued)

    def forget(self, request_id: str) -> None:
        """``request_id`` finished: nothing more is kept about it (its loads, if any, still retire)."""
        self._refused.discard(request_id)
        self._withdraw(request_id)

    def waiting_for(self, request_id: str) -> bool:
        """``request_id`` has a load not yet retired."""
        return any(load.request_id == request_id for load in (*self._queued, *self._issued))

    def _finish(self, load: PlannedLoad) -> None:
        for key in load.keys:
            left = self._loading[key] - 1
            if left:
                self._loading[key] = left
            else:
                del self._loading[key]
            self.tier.unpin(key)
        self._release(load.blocks)
