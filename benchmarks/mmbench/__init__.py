"""The many-models-on-one-GPU benchmark, in parts (``benchmarks/multi_model.py`` runs it).

``workload``  which model gets which prompt when: seeded, bursty, staggered, open loop
``client``    streams completions from OpenAI-compatible servers and times every token
``sampling``  GPU memory per server, ``/metrics`` and the kvelastic account over time
``summary``   TTFT/TPOT percentiles, SLO attainment, goodput, preemptions, reclaim episodes
``compare``   token-exact comparison of two runs of the same workload
"""
