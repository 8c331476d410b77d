"""What runs where vLLM allocates KV memory (the worker, and the engine core's planning of it).

``allocation`` backs vLLM's per-layer KV tensors (bands A and B) with the page
pool and publishes them to the scheduler; ``single_backing`` does the same for
band C's one backing, whose views stay vLLM's own; both describe each block's
bytes with ``kvelastic.pool.kv_layout`` (pure geometry, shared with the core).
``layout_preference``, ``page_alignment`` and ``whole_page_blocks`` choose a
layout and a block count for which page groups own whole pages;
``sleep_mode`` refuses what would free memory kvelastic does not hold.
"""
