"""Executor: refuse what cannot carry the protocol; tell Ray's ranks who drives them; bring descriptions back.

Around ``Executor.initialize_from_config`` (every executor inherits it; the
ranks make their KV caches inside it), where the ranks run in processes of
their own (``mp``, ``ray``): first the refusals (an executor that is not a
``MultiprocExecutor``, i.e. Ray v1; a vLLM whose engine loop cannot be woken,
before 0.18), then under Ray a ``collective_rpc`` with a callable telling each
rank that this engine core drives it: vLLM pickles the callable by reference and
its workers call it with their worker first (``run_method``). After vLLM's own
call a second such call brings every rank's description back on its reply, for
the scheduler. Any other backend passes straight through. See
``kvelastic.tp.executor_handover``.
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
COLLECTIVE_RPC = Target(  # called with a callable (the descriptions; under Ray the hand-over first); a MultiprocExecutor
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
    from kvelastic.patches import engine_core_wake
    from kvelastic.tp.executor_handover import wrap_initialize

    wakeable = engine_core_wake.PATCH.claims(patcher.version)  # the engine loop can be woken for an empty step
    patcher.wrap(INITIALIZE, wrap_initialize(runtime.rank_handovers, patcher.version, wakeable))


PATCH = Patch("executor_handover", "Executor: what cannot carry the protocol refused; each rank's description "
              "handed back", ALL, TARGETS, apply)
