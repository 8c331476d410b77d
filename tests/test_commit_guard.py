"""The commit guard on its own: what it maps on vLLM's estimate, what it holds, and what it leaves alone.

The queue is the real page-aware queue over a host-backed cache whose device
can be made to refuse (``OutsiderBackend``); the coordinators are stand-ins
with the estimate's parameters as each band of vLLM releases declares them.
"""

from __future__ import annotations

import pytest

from kvelastic.hooks import commit_guard
from kvelastic.scheduler.free_queue import PageAwareFreeQueue
from kvelastic.scheduler.mapper import GroupMapper
from kvelastic.patches import admission_check
from kvelastic.patching.apply import Patcher
from kvelastic.patching.versions import Version
from tests.kv_fixtures import BLOCKS_PER_GROUP, build_cache
from tests.test_device_refusal import OutsiderBackend


class Block:
    """What the queue reads of vLLM's KVCacheBlock."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.block_hash = None


class AsyncMapper(GroupMapper):
    """A mapper like the tensor-parallel one: nothing is mapped within a call."""

    synchronous = False

    def __init__(self, cache):
        super().__init__(cache)
        self.waited = 0

    def map_now(self, groups, *, force=False):
        self.waited += 1


@pytest.fixture
def built():
    backend = OutsiderBackend()
    pool, views, cache = build_cache(backend=backend)
    made = []

    def make(mapper_type=GroupMapper, **options):
        blocks = [Block(i) for i in range(cache.num_blocks)]
        queue = PageAwareFreeQueue(cache, blocks, blocks[1:], lambda block: None, mapper_type(cache),
                                   max_ahead_groups=1, **options)
        made.append(queue)
        return queue

    yield make, backend, pool
    del views
    pool.close()


def _mapped_free(queue) -> int:
    """Free blocks in mapped groups: what can be taken without asking the device."""
    return queue.mapped_free_blocks()  # groups the mapper has mapped since included


def _coordinator(params: tuple[str, ...]):
    """A stand-in whose estimate has ``params`` (``self`` dropped) and answers ``num_tokens`` blocks."""
    names = ", ".join(params[1:])
    namespace: dict = {}
    exec(f"def get_num_blocks_to_allocate(self, {names}):\n    return num_tokens", namespace)  # noqa: S102
    return type("Coordinator", (), namespace)()


def _bands():
    return [(str(signature.versions.low), signature.params) for signature in admission_check.ESTIMATE.shapes]


def _install(coordinator, queue, low: str):
    """The guard on ``coordinator`` as attaching does it for release ``low`` (cleared for the estimate only)."""
    return commit_guard.install(coordinator, queue, Patcher(Version.parse(low), [admission_check.ESTIMATE]))


@pytest.mark.parametrize(("low", "params"), _bands(), ids=[low for low, _ in _bands()])
def test_every_bands_estimate_secures_unless_it_is_an_admission_check(built, low, params):
    make, _, _ = built
    queue = make()
    coordinator = _coordinator(params)
    _install(coordinator, queue, low)
    assert coordinator.kvelastic_guard.queue is queue
    args = {name: 0 for name in params[1:]}
    args.update(request_id="r", num_tokens=100)
    if "apply_admission_cap" in params:
        args["apply_admission_cap"] = True
        assert coordinator.get_num_blocks_to_allocate(**args) == 100
        assert queue.hold.secured == 0, "an admission check secured blocks"
        positional = [args[name] for name in params[1:]]
        assert coordinator.get_num_blocks_to_allocate(*positional) == 100
        assert queue.hold.secured == 0, "a positional admission flag was missed"
        args["apply_admission_cap"] = False
    assert coordinator.get_num_blocks_to_allocate(**args) == 100
    assert queue.hold.secured == 100
    assert queue.num_free_blocks >= 100 and _mapped_free(queue) >= 100  # mapped now, not promised


def test_groups_secured_for_an_allocation_outlive_the_first_of_several_takes(built):
    """A hybrid coordinator takes its blocks in several popleft_n; the device may be gone by the second."""
    make, backend, pool = built
    queue = make()
    guard = commit_guard.CommitGuard(queue)
    guard.secure(100)
    backend.outsider = True
    first = queue.popleft_n(50)
    pool.collect(wait=True)
    pool.trim_reserve(0)  # as the reclaimer may: a group released here could not come back
    second = queue.popleft_n(50)  # without the hold, the first take's balance released a group it needed
    assert len({b.block_id for b in first + second}) == 100
    guard.end_step()
    assert queue.hold.secured == 0


def test_a_refusal_removes_unmapped_groups_from_the_free_count_until_the_step_ends(built):
    make, backend, _ = built
    queue = make()
    guard = commit_guard.CommitGuard(queue)
    mapped_free = _mapped_free(queue)
    backend.outsider = True
    guard.secure(mapped_free + 2 * BLOCKS_PER_GROUP)
    assert guard.refusals == 1 and queue.hold.refused
    assert queue.num_free_blocks == mapped_free  # vLLM's check now fails: a scheduling miss
    guard.secure(mapped_free + 2 * BLOCKS_PER_GROUP)  # vLLM retrying after a preemption
    assert guard.refusals == 1, "the device was asked again within the step"
    guard.end_step()
    assert queue.num_free_blocks > mapped_free  # the next step may try again


def test_where_mapping_is_asynchronous_the_guard_never_waits_but_still_holds(built):
    make, _, _ = built
    queue = make(AsyncMapper)
    guard = commit_guard.CommitGuard(queue)
    guard.secure(10 * BLOCKS_PER_GROUP)
    assert queue.mapper.waited == 0
    assert queue.hold.secured == 10 * BLOCKS_PER_GROUP and not queue.hold.refused


@pytest.mark.parametrize(("low", "params"), _bands()[-1:], ids=[low for low, _ in _bands()[-1:]])
def test_where_mapping_is_asynchronous_the_estimate_is_not_wrapped(built, low, params):
    """Under TP the guard would cost a call per request per step and change nothing (see the next test)."""
    make, _, _ = built
    queue = make(AsyncMapper)
    coordinator = _coordinator(params)
    guard = _install(coordinator, queue, low)
    assert coordinator.kvelastic_guard is guard  # the admission patch of 0.19-0.20.1 still finds it
    assert "get_num_blocks_to_allocate" not in vars(coordinator), "the estimate was wrapped"
    args = {name: 0 for name in params[1:]}
    args.update(request_id="r", num_tokens=10 * BLOCKS_PER_GROUP, apply_admission_cap=False)
    assert coordinator.get_num_blocks_to_allocate(**args) == 10 * BLOCKS_PER_GROUP
    assert queue.hold.secured == 0 and queue.mapper.waited == 0


def test_where_mapping_is_asynchronous_nothing_in_a_step_releases_an_empty_group(built):
    """Why the TP guard needs no hold: allocations and frees within a step never balance there, so the
    groups vLLM counted on its estimate are all still mapped when it takes them; the step's end does."""
    make, _, _ = built
    queue = make(AsyncMapper)
    queue.want_blocks(3 * BLOCKS_PER_GROUP)  # the last step's demand: mapped at once (no mapper thread)
    assert queue.mapped_free_blocks() >= 3 * BLOCKS_PER_GROUP
    empty = set(queue.free.empty)
    assert len(empty) >= 3
    queue.prefetch.clear()
    queue.demand_groups = 0  # every empty group is surplus now
    taken = queue.popleft_n(BLOCKS_PER_GROUP + 1)
    queue.append_n(taken)
    queue.append_n([queue.popleft()])
    assert queue.free.empty == empty, "an allocation or a free within the step released an empty group"
    queue.want_blocks(0)  # the step's end: the surplus goes (the prefetch keeps what the burst used)
    assert len(queue.free.empty) <= queue.prefetch.groups < len(empty)


def test_the_admission_check_of_0_19_maps_nothing(built):
    make, _, _ = built
    queue = make()
    coordinator = _coordinator(admission_check.ESTIMATE.shape(Version(0, 19, 0)).params)
    guard = _install(coordinator, queue, "0.19.0")
    manager = type("Manager", (), {})()
    manager.coordinator = coordinator
    seen = []

    def can_fit_full_sequence(request):
        seen.append(guard.admitting)
        return coordinator.get_num_blocks_to_allocate("r", 200, (), 0, 0, 200) <= queue.num_free_blocks

    assert admission_check._can_fit(can_fit_full_sequence, manager, ("request",), {}) is True
    assert seen == [1] and guard.admitting == 0
    assert queue.hold.secured == 0
    plain = type("Manager", (), {})()  # a manager kvelastic did not attach to: vLLM's call as is
    plain.coordinator = _coordinator(admission_check.ESTIMATE.shape(Version(0, 19, 0)).params)
    assert admission_check._can_fit(lambda request: "as is", plain, ("request",), {}) == "as is"


# ------------------------------------------------------------ a burst up to the limit, as on the H100
class LateWorker(GroupMapper):
    """The mapper thread not woken yet: groups requested ahead wait in its queue until the scheduler's
    own map (``map_now``) waits for everything asked before it, as the thread's queue runs in order."""

    def __init__(self, cache):
        super().__init__(cache)
        self.asked: list[tuple[str, list[int]]] = []

    def start(self):
        """No thread: what is sent runs inline (the thread's order, without its timing)."""

    def request_map(self, groups):
        self.asked.append(("map", list(groups)))

    def request_unmap(self, groups, after=None):
        self._send_asked()
        super().request_unmap(groups, after=after)

    def map_now(self, groups, *, force=False):
        self._send_asked()
        super().map_now(groups, force=force)

    def _send_asked(self):
        asked, self.asked = self.asked, []
        for _, groups in asked:
            super().request_map(groups)


LIMIT_GROUPS = 16  # KVELASTIC_LIMIT=2GiB in groups of 128 MiB, the null group's included
AHEAD_GROUPS = 8  # KVELASTIC_PREFETCH=1GiB
PER_REQUEST = BLOCKS_PER_GROUP // 4  # 64 blocks of 256 a group


def _burst(mapper_type, *, reserve_groups: int):
    """64 requests admitted in one step that together need the whole limit, each through the guard."""
    pool, views, cache = build_cache(limit_groups=LIMIT_GROUPS, num_blocks=64 * BLOCKS_PER_GROUP)
    mapper = mapper_type(cache)
    mapper.start()
    blocks = [Block(i) for i in range(cache.num_blocks)]
    queue = PageAwareFreeQueue(cache, blocks, blocks[1:], lambda block: None, mapper,
                               max_ahead_groups=AHEAD_GROUPS)
    guard = commit_guard.CommitGuard(queue)
    pool.grow_reserve(reserve_groups * len(cache.layout.pages(1)))  # KVELASTIC_RESERVE(_HOST_RUNS), parked
    try:
        admitted = 0
        for _ in range(64):
            guard.secure(PER_REQUEST)
            if queue.num_free_blocks >= PER_REQUEST:
                queue.popleft_n(PER_REQUEST)
                admitted += 1
        guard.end_step()
        return guard, queue, admitted
    finally:
        mapper.stop()
        del views
        pool.close()


@pytest.mark.parametrize("reserve_groups", [0, 2, 7])
def test_near_the_limit_the_prefetch_never_asks_for_a_group_twice_over(reserve_groups):
    """The groups asked for ahead and not yet mapped are still in the pool's room: counted once more,
    the worker mapped past the limit and the guard took the limit's refusal for the device's."""
    guard, queue, admitted = _burst(LateWorker, reserve_groups=reserve_groups)
    capacity = (LIMIT_GROUPS * BLOCKS_PER_GROUP - 1) // PER_REQUEST  # block 0 is vLLM's null block
    assert admitted == capacity
    assert queue.refused_groups == 0 and guard.refusals == 0


def test_a_burst_up_to_the_limit_with_the_mapper_thread_is_never_refused():
    """The same burst with the real worker thread (before the fix: one refusal in every run)."""
    for _ in range(5):
        guard, queue, _ = _burst(GroupMapper, reserve_groups=2)
        assert queue.refused_groups == 0 and guard.refusals == 0


def test_a_refusal_by_the_limit_is_logged_as_the_limits(built, kv_log):
    """The limit fell between the estimate and the map (the account's cap, ``kvelastic limit``): the
    log line names the limit, not another process."""
    make, _, pool = built
    queue = make(clock=lambda: 0.0)  # a frozen clock: the room read below is not read again
    guard = commit_guard.CommitGuard(queue)
    needed = _mapped_free(queue) + 2 * BLOCKS_PER_GROUP
    assert queue.num_free_blocks >= needed
    pool.set_limit(pool.stats().held_bytes)  # nothing more may be mapped
    guard.secure(needed)
    assert guard.refusals == 1
    assert "refused by this engine's limit (mapping" in kv_log.text
    assert "another process" not in kv_log.text and "outside kvelastic" not in kv_log.text


def test_a_refusal_by_the_device_is_logged_as_the_devices(built, kv_log):
    make, backend, _ = built
    queue = make()
    guard = commit_guard.CommitGuard(queue)
    backend.outsider = True
    guard.secure(_mapped_free(queue) + 2 * BLOCKS_PER_GROUP)
    assert "refused by the device: a process outside kvelastic's accounting took the memory" in kv_log.text


def test_a_refusal_by_the_shared_account_is_named_so():
    from kvelastic.cluster.errors import SharedBudgetExceeded

    refusal = SharedBudgetExceeded("instance 'a' may not map 8.00 MiB more")
    assert commit_guard.refusal_reason(refusal).startswith("the GPU's shared account (instance 'a'")
    assert commit_guard.refusal_reason(None) == "the pool (no reason recorded)"
