"""The configuration objects kvelastic reads, on the scheduler and in the workers.

Nothing here is wrapped: these are the fields read off ``VllmConfig`` (the
parallel layout, the model's name, the block size, the batch size, the KV
connector's configuration (``kv_connector_access.py``); from 0.29
also whether sleep mode is on and the block count override). Declaring
them lets the gate refuse a release that renamed one, where a ``getattr`` with
a default would have carried on with a wrong value.
"""

from __future__ import annotations

from kvelastic.patching.spec import Attributes, Target
from kvelastic.patches._common import ALL, BAND_C, BAND_D, BEFORE_BAND_C, FROM_BAND_C

VLLM_CONFIG = Target(
    module="vllm.config",
    qualname="VllmConfig",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("model_config", "parallel_config", "cache_config", "scheduler_config",
                           "kv_transfer_config")),),
)
PARALLEL_CONFIG = Target(  # pipeline stages refuse start-up; the world size counts the ranks to wait for
    module="vllm.config",
    qualname="ParallelConfig",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("world_size", "pipeline_parallel_size", "distributed_executor_backend")),),
)
_NAMES = ("model", "served_model_name")
MODEL_CONFIG = Target(  # the model's name (shared account), served name (metrics' model_name); sleep mode (0.29+)
    module="vllm.config",
    qualname="ModelConfig",
    kind="class",
    use="read",
    shapes=(Attributes(BEFORE_BAND_C, _NAMES), Attributes(FROM_BAND_C, (*_NAMES, "enable_sleep_mode"))),
)
CACHE_CONFIG = Target(  # tokens per block; from 0.29 the block count override the whole-page rounding sets
    module="vllm.config",
    qualname="CacheConfig",
    kind="class",
    use="read",
    shapes=(Attributes(BEFORE_BAND_C, ("block_size",)),
            Attributes(BAND_C, ("block_size", "num_gpu_blocks_override")),
            # 0.34: which sizing rule request_memory applies (patches/extensible_kv_cache.py)
            Attributes(BAND_D, ("block_size", "num_gpu_blocks_override", "enable_extensible_kv_cache",
                                "gpu_memory_utilization", "resolved_gpu_memory_utilization"))),
)
SCHEDULER_CONFIG = Target(  # the largest step, which sizes the KV cache's warm-up
    module="vllm.config",
    qualname="SchedulerConfig",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("max_num_batched_tokens",)),),
)

TARGETS = (VLLM_CONFIG, PARALLEL_CONFIG, MODEL_CONFIG, CACHE_CONFIG, SCHEDULER_CONFIG)
