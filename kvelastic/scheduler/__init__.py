"""Beside the scheduler, on block ids and page groups: kvelastic's scheduler-side core.

Nothing here imports vLLM or touches a vLLM object: ``hooks`` adapts vLLM's
block pool and scheduler to it. ``elastic_cache`` is one engine's cache (pool,
tensors, block-to-group layout); ``free_queue`` hands out blocks only from
mapped groups (``free_ledger`` keeps the books, ``free_order`` replays vLLM's
own free order, ``map_room`` how many more groups the pool could map);
``mapper`` runs driver calls off the scheduler's thread; ``prefetch`` sizes
the mapped headroom; ``upkeep`` runs the periodic jobs
(``reclaimer`` gives idle memory back, ``engine_report`` logs and exports);
``cluster_link`` is the engine's membership in its GPU's shared account
(``reclaim_timing`` times its waits for memory and its releases for others);
``allocation_hold`` is what the queue owes vLLM between its estimate and its
allocation.
"""
