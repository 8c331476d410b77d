"""Where vLLM's scheduler-side objects meet kvelastic's core: every change goes through the Patcher.

``scheduler`` attaches an engine's scheduler to its elastic cache;
``block_pool`` makes vLLM's ``BlockPool`` page-aware over the core's free
queue; ``commit_guard`` maps the groups an allocation needs before vLLM
decides to make it; ``connector_fence`` keeps groups mapped under vLLM's
offload connectors; ``offload_setup`` wires the host tier into the prefix
lookup; ``local_connection`` joins a scheduler to a cache in its own process
(``kvelastic.tp`` holds the connection to ranks in other processes). Each vLLM object touched is a contact declared in ``patches/``.
"""
