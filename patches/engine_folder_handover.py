"""Executor: under Ray, refuse what cannot work, else hand each rank its engine's folder before its KV cache.

A worker rank meets its scheduler in the engine's folder. Under the
multiprocess executor it names that folder from its parent, the engine core;
a Ray actor's parent is the raylet. So in front of
``Executor.initialize_from_config`` (every executor inherits it; the ranks
initialise their KV caches inside it) the engine core refuses Ray unless
``KVELASTIC_RAY=allow`` and the executor is Ray's V2 (a ``MultiprocExecutor``),
then sends every rank the folder with ``collective_rpc`` and a callable:
vLLM pickles it by reference and its workers call it with their worker first
(``run_method``). After vLLM's own call (the ranks made their KV caches) a
second such call brings every rank's description back on its reply, for the
scheduler. Any other backend passes straight through: the multiprocess path is
unchanged. See ``kvelastic.tp.ray_executor``.
"""

from __future__ import annotations

from typing import Any

from kvelastic.patching.spec import Attributes, Patch, Signature, Target
from kvelastic.patches._common import ALL, before, since

_ABSTRACT = "vllm.v1.executor.abstract"
_MP = "vllm.v1.executor.multiproc_executor"
_RPC = ("self", "method", "timeout", "args", "kwargs", "non_block", "unique_reply_rank", "kv_output_aggregator")

EXECUTOR = Target(  # its config tells the backend (ParallelConfig's fields: patches/engine_config.py)
    module=_ABSTRACT,
    qualname="Executor",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("vllm_config",)),),
)
INITIALIZE = Target(
    module=_ABSTRACT,
    qualname="Executor.initialize_from_config",
    kind="method",
    shapes=(Signature(ALL, ("self", "kv_cache_configs")),),
)
COLLECTIVE_RPC = Target(  # called with a callable (twice: the folder, the descriptions); only on a MultiprocExecutor
    module=_MP,
    qualname="MultiprocExecutor.collective_rpc",
    kind="method",
    use="read",
    shapes=(Signature(before("0.28"), _RPC), Signature(since("0.28"), (*_RPC, "ec_output_aggregator"))),
)
RUN_METHOD = Target(  # on the worker: a pickled callable is called with the worker first, then args
    module="vllm.v1.serial_utils",
    qualname="run_method",
    kind="function",
    use="read",
    shapes=(Signature(ALL, ("obj", "method", "args", "kwargs")),),
)
TARGETS = (EXECUTOR, INITIALIZE, COLLECTIVE_RPC, RUN_METHOD)


def apply(patcher: Any, runtime: Any) -> None:
    from kvelastic.tp.ray_executor import wrap_initialize

    settings = runtime.settings
    patcher.wrap(INITIALIZE, wrap_initialize(settings.ray, runtime.ray_handovers, settings.tp_confirm))


PATCH = Patch("engine_folder_handover", "Executor: Ray refused or accepted; each rank handed its engine's folder, "
              "its description handed back",
              ALL, TARGETS, apply)
