"""Growing a pool's warm reserve a chunk of pages at a time, so the pool's lock is never held long.

:meth:`PagePool.grow_reserve` holds the pool's lock while it creates its pages
and maps them ahead (parks them). Regrowing a host run's reserve right after a
reload used it is 2 GiB: hundreds of driver calls, tens of milliseconds beside
the GPU's kernels. A map the scheduler waits for (the mapper's, or a rank's
step) needs the same lock, and would wait for all of them. Grown a chunk per
call, with a yield between calls, it waits for about one chunk, and the total work is the same;
and no chunk starts while the mapper has work (a reload's own maps, say). Within a chunk the pool
itself now steps aside for a waiting thread between batches of pages (:mod:`kvelastic.pool.warm_pages`);
the chunks still bound what one call does, and let the caller stop while the mapper is busy.
"""

from __future__ import annotations

import time
from typing import Callable

from kvelastic.roles import PoolView

#: Pages one call creates and parks at most: one page group of the 8B shape (32 KV tensors of one
#: 8 MiB page), a few milliseconds of driver calls.
GROW_CHUNK_BYTES = 256 * 1024 * 1024


def grow_in_chunks(pool: PoolView, pages: int, *, wait_for: Callable[[], bool] = lambda: False) -> int:
    """``pool.grow_reserve(pages)`` a :data:`GROW_CHUNK_BYTES` at a time; return the pages added.

    Stops at the first chunk the pool grows short (its limit or the device), and before any chunk
    while ``wait_for()`` is true (maps the scheduler may wait for are queued: growing is never
    urgent, the caller grows the rest on its next round). ``pages`` 0 makes one call, which still
    parks recycled pages.
    """
    chunk = max(1, GROW_CHUNK_BYTES // pool.page_bytes)
    added = 0
    while True:
        step = min(chunk, pages - added)
        if step > 0 and wait_for():
            return added
        got = pool.grow_reserve(step)
        added += got
        if got < step or added >= pages:
            return added
        time.sleep(0)  # a thread waiting for the lock takes it now: an unfair lock would go back to this one
