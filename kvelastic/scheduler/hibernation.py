"""An engine's KV memory given back while vLLM sleeps, and taken again on use once it wakes.

vLLM's sleep (levels 1 and 2) and its ``release_kv_cache_memory`` drop the prefix
cache and free the KV cache's memory. kvelastic's KV pages are in no allocator
pool of vLLM's, so the engine gives them back itself: every cached block is
evicted, every empty group unmapped, the warm reserve and the parked pages
returned to the device, and with them the bytes charged to the GPU's shared
account, whose other engines may use them at once. Only the group of vLLM's null
block stays mapped: vLLM holds that block for the engine's life, and a group is a
few MiB.

While asleep the pool's limit is that one group and the upkeep runs no job (its
account sync would raise the limit again, its warm reserve would grow), so nothing
maps: a request scheduled meanwhile waits, as at any limit. Waking gives the limit
back; groups then map as requests use them, as after start-up.

The engine's want in the account goes too: a refusal it met just before sleeping
would otherwise hold the other engines to their fair shares for a few seconds
more, while it needs nothing.

A host tier's copies go too, whatever path reached the sleep: an RL loop loads
new weights while the engine sleeps, and KV computed with the old ones must never
come back. vLLM's own reset of the prefix cache drops them where it runs (every
engine core from 0.17; before, the ``LLM`` and ``AsyncLLM`` front ends); the
hibernation drops them again after its release, which also spilled what was
still cached.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, ContextManager

if TYPE_CHECKING:
    from kvelastic.roles import Mapper
    from kvelastic.scheduler.elastic_cache import ElasticKVCache
    from kvelastic.scheduler.free_queue import PageAwareFreeQueue
    from kvelastic.scheduler.upkeep import UpkeepThread

log = logging.getLogger("vllm.kvelastic")


class Hibernation:
    """Sleep and wake for one engine whose KV cache is in this process."""

    def __init__(self, queue: "PageAwareFreeQueue", cache: "ElasticKVCache", mapper: "Mapper",
                 upkeep: "UpkeepThread", lock: ContextManager,
                 drop_host_copies: Callable[[], None] | None = None,
                 withdraw_want: Callable[[], object] | None = None):
        """``lock``: the scheduler's lock (taken by every entry point and upkeep job that changes the pool);
        ``drop_host_copies``: the host tier's reset, where the engine has one; ``withdraw_want``: tells the
        GPU's shared account the engine wants nothing, where it is a member."""
        self.queue = queue
        self.cache = cache
        self.mapper = mapper
        self.upkeep = upkeep
        self.lock = lock
        self.drop_host_copies = drop_host_copies
        self.withdraw_want = withdraw_want
        self._limit_awake: tuple[int | None] | None = None  # the pool's limit before sleep; None: awake

    @property
    def asleep(self) -> bool:
        return self._limit_awake is not None

    def sleep(self) -> int:
        """Give back every KV page but the null block's group; return the bytes the pool still holds.

        Blocks a request still holds stay mapped (vLLM resets its prefix cache and
        its running requests before it sleeps, so there are none on its own paths).
        Asleep already: nothing more to do.
        """
        pool = self.cache.pool
        if self.asleep:
            return pool.stats().held_bytes
        self.upkeep.pause()  # outside the lock: a tick under way may be waiting for it
        try:
            with self.lock:
                self._limit_awake = (pool.stats().limit_bytes,)
                pool.set_limit(self.cache.group_bytes)
                self.queue.reclaim_cached(groups_wanted=self.cache.num_groups)
            for _ in range(2):  # twice: a map asked for before the limit dropped may land during the first
                with self.lock:
                    self.queue.set_idle()  # no group kept ahead: every empty one is released
                self.mapper.map_now([])  # the unmaps just asked for are carried out
            pool.collect(wait=True)  # and their pages released once the GPU is done with them
            pool.set_limit(self.cache.group_bytes)  # pages parked or kept warm meanwhile go too
            if self.drop_host_copies is not None:
                with self.lock:
                    self.drop_host_copies()
            if self.withdraw_want is not None:  # a want from before sleep would hold the others to shares
                self.withdraw_want()
        except BaseException:
            if self._limit_awake is None:
                self.upkeep.resume()
            else:
                self.wake()
            raise
        held = pool.stats().held_bytes
        log.info("kvelastic: asleep: KV pages given back; %d MiB held (the null block's group%s)", held >> 20,
                 "" if held <= self.cache.group_bytes else " and blocks still in use")
        return held

    def wake(self) -> None:
        """The limit the engine had before sleep; groups map again as requests use them."""
        if self._limit_awake is None:
            return
        (limit,) = self._limit_awake
        with self.lock:
            self.cache.pool.set_limit(limit)
            self._limit_awake = None
        self.upkeep.resume()
        log.info("kvelastic: awake: KV pages map again as requests use them")
