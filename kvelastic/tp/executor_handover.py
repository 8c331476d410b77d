"""The engine core's side of its executor: refuse what cannot carry the protocol, else learn the ranks.

Runs around ``Executor.initialize_from_config`` (the wrap in
``kvelastic.patches.executor_handover``), in which every rank makes its KV
cache. The protocol rides vLLM's own calls: each step's plan goes to every rank
with the step, each rank's report comes back on its reply to a report step, and
commands queued while the engine idles ride a step of no tokens that kvelastic
wakes vLLM's engine loop for. So the executor must be a ``MultiprocExecutor``
(vLLM's multiprocess executor, or Ray's V2 executor, its subclass, vLLM 0.20+),
which broadcasts every step to every rank and gathers every rank's reply when
asked, and vLLM must be one whose loop can be woken (0.18+). Anything else is
refused here, before any rank makes its cache:

* Ray's v1 executor (a compiled DAG) calls the model runner directly, past the
  ``Worker.execute_model`` where a rank applies its plan, and under pipeline
  parallelism stage k's reply never reaches the scheduler;
* before vLLM 0.18 the engine loop has no wake-up request, so an idle engine
  would never give its memory back.

Under Ray the engine core first tells every rank that it drives it
(:func:`kvelastic.tp.rank_handover.receive`). Once vLLM's own call returned,
every rank's description comes back over the same channel
(:func:`collect_descriptions`), kept in the process runtime's
:class:`~kvelastic.tp.handovers.RankHandovers`, where the scheduler, built next, reads it.
Under the uniprocess executor nothing happens: the cache is in this process.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from kvelastic.errors import PatchError
from kvelastic.tp.handovers import RankHandovers
from kvelastic.tp.rank_handover import describe, host_identity, receive

log = logging.getLogger("vllm.kvelastic")

RAY = "ray"
RANK_BACKENDS = ("mp", RAY)  # executors whose ranks kvelastic serves in their own processes
FIRST_WAKEABLE = "0.18"  # EngineCoreRequestType.WAKEUP exists (patches/engine_core_wake.py)


def refusal(executor: Any, parallel: Any, version: Any, wakeable: bool) -> str | None:
    """Why this engine's executor cannot carry the protocol (``wakeable``: vLLM ``version``'s engine loop can be
    woken); None if it can."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor  # declared in the patch module

    if not isinstance(executor, MultiprocExecutor):
        return ray_v1_refusal(executor, parallel)
    if not wakeable:
        return (f"kvelastic: vLLM {version} cannot wake its engine loop for a step of no tokens (it has no "
                f"wake-up request before {FIRST_WAKEABLE}), so commands that give an idle engine's memory back "
                f"would never reach its worker ranks. kvelastic serves worker ranks in their own processes (tensor, "
                f"pipeline or data parallelism, the multiprocess executor) on vLLM {FIRST_WAKEABLE} and later; on "
                f"vLLM {version} run one GPU with the uniprocess executor (--distributed-executor-backend uni), "
                f"upgrade vLLM, or set KVELASTIC=0")
    return None


def ray_v1_refusal(executor: Any, parallel: Any) -> str:
    """The refusal of a Ray executor that is not a ``MultiprocExecutor`` (Ray v1)."""
    stages = int(parallel.pipeline_parallel_size)
    pipeline = (f"; and with {stages} pipeline stages, stage k's reply would never reach the scheduler"
                if stages > 1 else "")
    return (f"kvelastic: vLLM's Ray executor v1 ({type(executor).__name__}, a compiled DAG) runs each step "
            f"through the model runner directly, past the Worker.execute_model where a rank applies "
            f"kvelastic's commands{pipeline}. Use Ray's V2 executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1: "
            f"vLLM 0.20 and later, the default from 0.21), the multiprocess executor, or set KVELASTIC=0")


def hand_over(executor: Any, handovers: RankHandovers, version: Any, wakeable: bool) -> bool:
    """Before the ranks make their KV caches: refuse (PatchError) what cannot work, and under Ray tell every
    rank this engine core drives it. True where the ranks run in processes of their own."""
    parallel = executor.vllm_config.parallel_config  # fields declared in patches/engine_config.py
    backend = parallel.distributed_executor_backend
    if backend not in RANK_BACKENDS:
        return False
    why = refusal(executor, parallel, version, wakeable)
    if why is not None:
        raise PatchError(why)
    if backend == RAY:
        replies = executor.collective_rpc(receive, args=(os.getpid(),))
        here = host_identity()
        elsewhere = [pid for pid, host in replies if host != here]
        log.info("kvelastic: the Ray workers (pids %s) serve this engine core%s", [pid for pid, _ in replies],
                 f"; those on other hosts (pids {elsewhere}) share no GPU account on this host" if elsewhere else "")
    handovers.asked()
    return True


def collect_descriptions(executor: Any, handovers: RankHandovers) -> None:
    """After vLLM's ``initialize_from_config``: ask every rank for its description over ``collective_rpc`` and
    keep them in ``handovers`` for the scheduler, checked as untrusted input. Kept only if ranks 0..world-1 each
    sent one; otherwise the scheduler refuses to start, naming what is missing."""
    from kvelastic.tp.rank_info import decode_info

    replies = executor.collective_rpc(describe)
    if not all(isinstance(reply, bytes) for reply in replies):
        log.warning("kvelastic: %d of %d workers sent no description (kvelastic is not active in them)",
                    sum(not isinstance(reply, bytes) for reply in replies), len(replies))
        return
    infos = sorted((decode_info(reply, f"the description worker {i} sent") for i, reply in enumerate(replies)),
                   key=lambda info: info.rank)
    if [info.rank for info in infos] != list(range(len(infos))):
        log.warning("kvelastic: the workers described ranks %s, not each of 0..%d once",
                    [info.rank for info in infos], len(infos) - 1)
        return
    handovers.keep_descriptions(infos)


def wrap_initialize(handovers: RankHandovers, version: Any, wakeable: bool) -> Any:
    """The wrapper of ``Executor.initialize_from_config``: the refusals and the hand-over first, then vLLM's own
    call (the ranks make and describe their KV caches), then their descriptions, kept in ``handovers``."""
    return functools.partial(_initialize_from_config, handovers, version, wakeable)


def _initialize_from_config(handovers: RankHandovers, version: Any, wakeable: bool, wrapped: Any, executor: Any,
                            args: tuple, kwargs: dict) -> Any:
    ranks = hand_over(executor, handovers, version, wakeable)
    result = wrapped(*args, **kwargs)
    if ranks:
        collect_descriptions(executor, handovers)
    return result
