"""The roles the scheduler side works with, each filled in two ways: in this process, or on worker ranks.

With one GPU and the uniprocess executor the scheduler shares its process
with the KV cache; under tensor parallelism (or the multiprocess executor)
the cache lives on worker ranks in other processes. Everything above these
roles (the page-aware queue, the commit guard, the host tier's manager, the
upkeep jobs) is written once, against them:

============================  ====================================  ===================================
role                          in this process                       on worker ranks (:mod:`kvelastic.tp`)
============================  ====================================  ===================================
:class:`PoolView`             :class:`~kvelastic.pool.PagePool`     ``ShardedPoolView``
:class:`SchedulerCache`       ``ElasticKVCache``                    ``ShardedKVCache``
:class:`Mapper`               ``GroupMapper`` (a thread)            ``RemoteMapper`` (numbered commands)
:class:`Copier`               ``BlockCopier``                       ``RemoteCopier``
============================  ====================================  ===================================

Every implementation subclasses its role, so a method it lacks is an error
when it is built, not a silent ``None`` later. Which of the two an engine
gets is decided once, when the scheduler attaches: the hooks' connection
(:class:`kvelastic.hooks.connection.CacheConnection`, ``LocalConnection`` or
``RankConnection``) builds them, and nothing after that asks which one it holds.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    from kvelastic.pool.kv_layout import KVGroupLayout
    from kvelastic.pool.backend import Fence
    from kvelastic.pool.lock_waits import LockWaits
    from kvelastic.pool.stats import PoolStats
    from kvelastic.scheduler.reclaim_timing import ReclaimTiming

__all__ = ["PoolView", "SchedulerCache", "Mapper", "Copier", "AccountLink"]


class AccountLink(Protocol):
    """An engine's membership in its GPUs' shared accounts, as upkeep uses it: a ``ClusterLink``
    (one GPU) or a ``LinkGroup`` (an engine over several)."""

    name: str
    timing: "ReclaimTiming"

    def tick(self, queue: Any, offload: Any) -> int:
        """Report, apply the limit; the bytes other engines want back."""

    def withdraw_want(self) -> bool:
        """The engine wants nothing now (asleep); False where an account could not hear it."""

    def leave(self) -> None: ...


class PoolView(Protocol):
    """What the scheduler side reads and asks of the page pool: mapped groups, room, upkeep."""

    page_bytes: int

    @abstractmethod
    def is_mapped(self, group: int) -> bool: ...

    @abstractmethod
    def headroom_estimate(self, device_free: int | None) -> int | None:
        """Bytes that could still be mapped, given ``device_free`` bytes free on the device (None: unknown)."""

    @abstractmethod
    def stats(self) -> "PoolStats": ...

    @abstractmethod
    def collect(self, wait: bool = False) -> int:
        """Finish what waits on the GPU (fenced unmaps, or commands queued while idle)."""

    @abstractmethod
    def grow_reserve(self, pages: int) -> int: ...

    @abstractmethod
    def trim_reserve(self, keep_pages: int = 0) -> int: ...

    @abstractmethod
    def set_limit(self, limit_bytes: int | None) -> None:
        """The most bytes the pool may hold from now on (the GPU's shared account moves it at run time)."""

    def lock_waits(self) -> "LockWaits | None":
        """This process's waits for the pool's lock; None where the pool is the ranks' (tensor parallelism)."""
        return None


class SchedulerCache(Protocol):
    """The engine's KV cache as the scheduler side sees it: its block layout, its pool, the room left."""

    layout: "KVGroupLayout"
    group_bytes: int
    pool: PoolView
    #: Told the bytes waiting requests need beyond what a budget outside the engine grants; None: no such budget.
    external_want: "Callable[[int], None] | None"
    #: Bytes a budget outside the engine (the GPU's shared account) still grants it; None: no such budget.
    external_headroom: "Callable[[], int | None] | None"

    @property
    @abstractmethod
    def blocks_per_group(self) -> int: ...

    @property
    @abstractmethod
    def num_groups(self) -> int: ...

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @abstractmethod
    def group_of_block(self, block_id: int) -> int: ...

    @abstractmethod
    def blocks_of_group(self, group: int) -> range: ...

    @abstractmethod
    def mappable_groups(self, unmapped: int) -> int:
        """How many of ``unmapped`` groups could be mapped now, within the limit and the device."""

    @abstractmethod
    def device_room(self) -> int | None:
        """Bytes the device (and a budget outside the engine) can still give this cache; None if unknown."""

    @abstractmethod
    def forget_device_free(self) -> None:
        """A map was refused that the last free-memory reading allowed: read it again next time."""


class Mapper(Protocol):
    """Maps and unmaps page groups for the page-aware queue, in the order asked.

    Groups come back through ``mapped`` and ``refused``, which the queue
    drains. ``synchronous``: :meth:`map_now` returns with its groups mapped or
    refused; where it cannot (ranks in other processes confirm a step later)
    the queue promises only groups already mapped.
    """

    synchronous: bool
    #: Whether a group requested and not yet mapped already holds its room in the cache's headroom
    #: (a mapper that charges a budget when it sends the command, as the ranks' does). Where False, the
    #: pool takes the pages only when the group is mapped, so until then the room still counts it and
    #: the queue must not request it twice over (``PageAwareFreeQueue._room_to_request``).
    requests_hold_room: bool = True
    #: Groups mapped since the queue last looked, for it to adopt (it pops them). The queue reads this
    #: and ``refused`` on every free count and rebalance, dozens of times a step: a plain attribute.
    mapped: deque[int]
    #: Groups that could not be mapped, for the queue to put back among the unmapped ones.
    refused: deque[int]

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def request_map(self, groups: Iterable[int]) -> None: ...

    @abstractmethod
    def request_unmap(self, groups: Iterable[int], after: "Fence | None" = None) -> None:
        """Unmap ``groups`` once the GPU is done with them and ``after`` (a copy out of them) has passed."""

    @abstractmethod
    def map_now(self, groups: list[int], *, force: bool = False) -> None:
        """Map ``groups`` after everything requested before; wait for it where the mapper is synchronous."""

    def busy(self) -> bool:
        """Whether commands are queued or running in this process now (the warm reserve's growth waits for
        them: it needs the pool's lock, and a map may be what the scheduler waits for). False where the
        maps run elsewhere (the ranks)."""
        return False


class Copier(Protocol):
    """Copies whole KV blocks to host slots and back, one batch a call."""

    bytes_per_block: int
    #: Whether :meth:`store_beside` can run beside the other copies (a second stream in this process).
    side_stores: bool = False

    @abstractmethod
    def store(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = False) -> "Fence":
        """Blocks to host slots; ``block_compute``: later compute waits for it (the blocks are reused)."""

    @abstractmethod
    def load(self, block_ids: Sequence[int], slots: Sequence[int], *, block_compute: bool = True) -> "Fence":
        """Host slots into blocks; ``block_compute``: the next forward pass waits for it (it reads the
        blocks). False: an asynchronous load, whose request is scheduled only once the fence passed."""

    def store_beside(self, block_ids: Sequence[int], slots: Sequence[int]) -> "Fence":
        """A write-through store beside the other copies, where the copier has a stream for it
        (:attr:`side_stores`); by default an ordinary store nothing waits for."""
        return self.store(block_ids, slots, block_compute=False)

    def wait_for(self, fences: Sequence["Fence"]) -> None:
        """The next copies start only once ``fences`` (of :meth:`store_beside`) passed; nothing to do where
        every copy runs on one stream."""

    @abstractmethod
    def fence_compute(self) -> None:
        """The next forward pass waits for every copy issued so far (a block a store reads is reused)."""

    @abstractmethod
    def copy_times(self) -> dict[str, float] | None:
        """GPU seconds and bytes of the copies done so far (``store_seconds``, ``load_seconds``,
        ``store_timed_bytes``, ``load_timed_bytes``), or None where this process cannot see them."""
