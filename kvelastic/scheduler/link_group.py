"""An engine over several GPUs, a member of each GPU's shared account, acting as one link.

Under tensor or pipeline parallelism each rank's pages live on its own GPU, and
every rank maps the same page groups. The scheduler joins every GPU's account
(one :class:`~kvelastic.scheduler.cluster_link.ClusterLink` per GPU, each
charged with the bytes a group takes on that GPU) and gates the cache with all
of them at once: the room it may still map is the least any account grants, a
shortfall is told to every account, and the pool's limit is the least any sets.
The links count in their GPU's bytes (a pipeline stage's group is smaller than
the largest stage's); the cache counts every group at the largest, so each
answer is scaled by the ratio of the two.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvelastic.roles import SchedulerCache
from kvelastic.scheduler.cluster_link import ClusterLink


class LinkGroup:
    """One membership per GPU, presented to the reclaimer and the metrics as a single link."""

    def __init__(self, cache: SchedulerCache, links: Sequence[ClusterLink]):
        self.cache = cache
        self.links = list(links)
        self.name = self.links[0].name
        self.timing = self.links[0].timing  # reclaim episodes as the first GPU's account sees them
        cache.external_headroom = self.headroom
        cache.external_want = self.want

    def _in_cache_bytes(self, link: ClusterLink, nbytes: int) -> int:
        return nbytes * self.cache.group_bytes // link.group_bytes

    def headroom(self) -> int | None:
        """The least room any account grants (in the cache's bytes); None if no account answers."""
        rooms = [self._in_cache_bytes(link, room) for link in self.links if (room := link.headroom()) is not None]
        return min(rooms) if rooms else None

    def want(self, nbytes: int) -> None:
        """Requests wait for ``nbytes`` (the cache's bytes): every GPU's account hears its share of it."""
        for link in self.links:
            link.want(nbytes * link.group_bytes // self.cache.group_bytes)

    def withdraw_want(self) -> bool:
        """Every GPU's account hears that this engine wants nothing now; False if any could not."""
        return all([link.withdraw_want() for link in self.links])

    def tick(self, queue: Any, offload: Any) -> int:
        """Report to every account, apply the least limit; the most bytes any account wants back."""
        limits, pressure = [], 0
        for link in self.links:
            limit, wanted = link.assess(queue, offload)
            if limit is not None:
                limits.append(self._in_cache_bytes(link, limit))
            pressure = max(pressure, self._in_cache_bytes(link, wanted))
        least = min(limits) if limits else None
        pool = self.cache.pool
        if least != pool.stats().limit_bytes:
            pool.set_limit(least)
        return pressure

    def leave(self) -> None:
        self.cache.external_headroom = None
        self.cache.external_want = None
        for link in self.links:
            link.leave()
