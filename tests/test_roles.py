"""Each scheduler-side role is filled completely by both its implementations, and they agree on the numbers.

One connection is to a host-backed cache in this process, the other to two
ranks (real ``RankWorker``s and their descriptions, run in this process for
speed; ``test_tp_protocol.py`` runs them as separate processes). Every member a role declares must exist on what
each connection hands out, with the role's parameters; and the room both
caches report must follow the same limit, device reading and margin.
"""

from __future__ import annotations

import inspect
import time

import pytest

from kvelastic import roles
from kvelastic.hooks.connection import CacheConnection
from kvelastic.scheduler.elastic_cache import DEVICE_MARGIN_BYTES
from kvelastic.hooks.local_connection import LocalConnection
from kvelastic.pool import HostBackend
from kvelastic.settings import Settings
from kvelastic.tp.scheduler_side import RankConnection
from kvelastic.tp.step_report import StepReport
from kvelastic.tp.worker_side import start_rank
from tests.kv_fixtures import GROUP_BYTES, build_cache

WORLD = 2
CPU_BYTES = 1 << 20


class ReportingBackend(HostBackend):
    """A host device that reports ``free`` bytes free, as the CUDA driver would."""

    def __init__(self, free: int | None):
        super().__init__()
        self.free = free

    def device_free_bytes(self) -> int | None:
        return self.free


@pytest.fixture
def connections(tmp_path, monkeypatch):
    """``make(free, limit_groups)``: (local, remote) connections whose devices report ``free`` bytes free."""
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    made: list = []

    def make(free: int | None = None, limit_groups: int | None = None):
        limit = limit_groups and limit_groups * GROUP_BYTES
        built = [build_cache(backend=ReportingBackend(free)) for _ in range(WORLD + 1)]
        made.extend(built)
        workers = [start_rank(cache, rank, WORLD, limit, CPU_BYTES) for rank, (_, _, cache) in enumerate(built[1:])]
        made.extend(workers)
        remote = RankConnection([worker.info for worker in workers])
        remote.mapper.adopt(StepReport(tuple(w.take_report() for w in workers)))  # a report step's replies
        return LocalConnection(built[0][2], limit), remote

    yield make
    for thing in reversed(made):
        if isinstance(thing, tuple):
            thing[0].close()
        else:
            thing.close()


def _role_objects(connection: CacheConnection) -> list[tuple[type, object]]:
    from kvelastic.offload.plan import host_plan

    plan = host_plan(cache_in_process=connection.unmaps_between_steps, loads_reported=connection.async_loads,
                     vllm_connector=None)  # as the scheduler's attach makes it
    tier, copier = connection.host_tier(Settings(cpu_bytes=CPU_BYTES), plan)
    return [(CacheConnection, connection), (roles.SchedulerCache, connection.cache),
            (roles.PoolView, connection.cache.pool), (roles.Mapper, connection.mapper), (roles.Copier, copier)]


def _parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("where", ["local", "ranks"])
def test_both_connections_fill_every_role_completely(connections, where):
    local, remote = connections()
    for role, thing in _role_objects(local if where == "local" else remote):
        kind = type(thing)
        assert role in kind.__mro__, f"{kind.__name__} does not declare the {role.__name__} role"
        assert not kind.__abstractmethods__, f"{kind.__name__} leaves {sorted(kind.__abstractmethods__)} open"
        declared = [*role.__annotations__, *(name for name in vars(role) if not name.startswith("_"))]
        for name in declared:
            assert hasattr(thing, name), f"{kind.__name__} has no {name}, which {role.__name__} declares"
            member = vars(role).get(name)
            if inspect.isfunction(member):
                assert _parameters(getattr(kind, name)) == _parameters(member), f"{kind.__name__}.{name}"


def test_the_two_caches_count_the_same_room_beyond_the_device_margin(connections):
    local, remote = connections(free=DEVICE_MARGIN_BYTES + 3 * GROUP_BYTES + GROUP_BYTES // 2)
    # each pool holds group 0 (the null block); the device has room for 3 more groups beyond the margin
    assert local.cache.mappable_groups(10) == remote.cache.mappable_groups(10) == 3
    assert local.cache.mappable_groups(2) == remote.cache.mappable_groups(2) == 2


def test_the_two_caches_count_the_same_room_within_the_limit(connections):
    local, remote = connections(free=None, limit_groups=5)  # no device reading: the limit alone decides
    assert local.cache.mappable_groups(10) == remote.cache.mappable_groups(10) == 4


def test_ranks_backing_off_after_a_refusal_promise_no_room(connections):
    _, remote = connections(free=None)
    assert remote.cache.mappable_groups(10) == 10
    remote.mapper.backoff_until = time.monotonic() + 60  # as after a rank refused a group
    assert remote.cache.mappable_groups(10) == 0
