"""kvelastic inside vLLM: what the patches call once they have wrapped vLLM's functions.

Worker side: ``allocation`` and ``kv_layout`` back the KV tensors with the page
pool and describe their layout. Scheduler side: ``scheduler`` attaches the
engine's scheduler (``block_pool`` makes its GPU block pool page-aware over
``free_queue``, ``commit_guard`` maps on vLLM's block estimate,
``offload_setup`` wires the host tier, ``reclaimer``, ``mapper`` and
``prefetch`` keep memory following load). ``runtime`` holds one process's
state, ``activate`` switches all of it on (gate, then patches) or leaves vLLM
untouched, ``cluster_link`` and ``metrics*`` connect the engine to the GPU's
shared account and to ``/metrics``. Every vLLM object this package touches is
a contact declared in ``patches/`` and changed only through the Patcher.
"""
