"""On the GPU machine only (benchmarks put this folder on PYTHONPATH for vLLM 0.34 bundles).

vLLM 0.34's kernel warm-up imports its MiniMax-M3 MSA warm-up on every CUDA engine, and that
module imports NVIDIA's CuTe DSL (``cutlass``, about 95 MB of wheels), which the GPU bundle leaves
out. The warm-up only acts on MiniMax-M3 attention layers, which the benchmark models (Llama shapes)
do not have, so a no-op stands in for it in vanilla and kvelastic runs alike.
"""

import sys
import types

_NAME = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
try:
    import cutlass  # noqa: F401  (the real DSL present: nothing to stand in for)
except ImportError:
    _stub = types.ModuleType(_NAME)
    _stub.minimax_m3_msa_warmup = lambda worker: None
    sys.modules[_NAME] = _stub
