"""The engine core's side of vLLM's Ray executor: refuse it where it cannot work, else hand over the folder.

Runs in front of ``Executor.initialize_from_config`` (the wrap in
``kvelastic.patches.engine_folder_handover``), before any rank initialises its
KV cache and so before any rank looks for its engine's folder. Under the
multiprocess executor (and the uniprocess one) nothing happens: the ranks are
this process's children and find the folder from their parent, as always.

Under Ray only the V2 executor (``RayExecutorV2``, a ``MultiprocExecutor``
subclass: vLLM 0.20+, the default from 0.21, the only one in 0.33) can carry
the protocol: its workers run vLLM's ``WorkerProc`` busy loop, hence the
``Worker.execute_model`` where each rank applies its step's commands. Ray v1
(``RayDistributedExecutor``, a compiled DAG) calls the model runner directly,
past that hook, and under pipeline parallelism stage k's reply never reaches
the scheduler; it is refused with what to use instead. A rank on another host
refuses the hand-over itself (:func:`kvelastic.tp.engine_folder.receive`) unless
the engine confirms on the steps' replies (``KVELASTIC_TP_CONFIRM=step``), which the
hand-over says; then it runs with no folder, and the record says which ranks did.
Once vLLM's own call returned, every rank's description comes back over the
same channel (:func:`collect_descriptions`), kept in the process runtime's
:class:`~kvelastic.tp.handovers.RayHandovers`, where the scheduler, built next, reads it.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from kvelastic.errors import PatchError
from kvelastic.tp.handovers import RayHandovers
from kvelastic.tp.engine_folder import describe, host_identity, receive

log = logging.getLogger("vllm.kvelastic")

RAY = "ray"

def ray_refusal(setting: str, executor: Any, parallel: Any) -> str | None:
    """Why this engine's Ray executor cannot run with kvelastic (``setting``: ``KVELASTIC_RAY``); None if it can."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor  # declared in the patch module

    if setting != "allow":
        return ("kvelastic: vLLM's Ray executor (--distributed-executor-backend ray) is refused: "
                "KVELASTIC_RAY=refuse. Unset it (or set KVELASTIC_RAY=allow) "
                "to run Ray's V2 executor on one host, use the multiprocess executor "
                "(--distributed-executor-backend mp), or set KVELASTIC=0")
    if isinstance(executor, MultiprocExecutor):
        return None
    stages = int(parallel.pipeline_parallel_size)
    pipeline = (f"; and with {stages} pipeline stages, stage k's reply would never reach the scheduler"
                if stages > 1 else "")
    return (f"kvelastic: vLLM's Ray executor v1 ({type(executor).__name__}, a compiled DAG) runs each step "
            f"through the model runner directly, past the Worker.execute_model where a rank applies "
            f"kvelastic's commands{pipeline}. Use Ray's V2 executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1: "
            f"vLLM 0.20 and later, the default from 0.21), the multiprocess executor, or set KVELASTIC=0")


def hand_over_folder(executor: Any, ray_setting: str, handovers: RayHandovers, confirm: str = "board") -> Path | None:
    """Under Ray: refuse (PatchError) or tell every rank this engine's folder and how it confirms (its
    ``KVELASTIC_TP_CONFIRM``; ``auto`` is ``step`` on Ray's V2 executor, the only one accepted here: in ``step``
    a rank on another host takes no folder), and return the folder; otherwise None."""
    parallel = executor.vllm_config.parallel_config  # fields declared in patches/engine_config.py
    if parallel.distributed_executor_backend != RAY:
        return None
    refusal = ray_refusal(ray_setting, executor, parallel)
    if refusal is not None:
        raise PatchError(refusal)
    from kvelastic.tp.board import engine_dir
    from kvelastic.tp.remote_mapper import BOARD, STEP

    folder = engine_dir(os.getpid())
    here = host_identity()
    mode = BOARD if confirm == BOARD else STEP
    replies = executor.collective_rpc(receive, args=(str(folder), os.getpid(), here, mode))
    pids = [pid for pid, _ in replies]
    elsewhere = [pid for pid, host in replies if host != here]
    handovers.handed(folder, elsewhere)
    log.info("kvelastic: handed the Ray workers (pids %s) this engine's folder %s%s", pids, folder,
             f"; those on other hosts (pids {elsewhere}) run with no folder, on the steps' replies alone"
             if elsewhere else "")
    return folder


def collect_descriptions(executor: Any, folder: Path, handovers: RayHandovers) -> None:
    """After vLLM's ``initialize_from_config`` under Ray: ask every rank for its description over
    ``collective_rpc`` and keep them in ``handovers`` for the scheduler, checked as their files would
    be. Kept only if ranks 0..world-1 each sent one; else the scheduler reads their files as before."""
    from kvelastic.tp.rank_files import decode_info

    replies = executor.collective_rpc(describe)
    if not all(isinstance(reply, bytes) for reply in replies):
        log.warning("kvelastic: %d of %d Ray workers sent no description; the scheduler looks for their files",
                    sum(not isinstance(reply, bytes) for reply in replies), len(replies))
        return
    infos = sorted((decode_info(reply, f"the description Ray worker {i} sent") for i, reply in enumerate(replies)),
                   key=lambda info: info.rank)
    if [info.rank for info in infos] != list(range(len(infos))):
        log.warning("kvelastic: the Ray workers described ranks %s; the scheduler looks for their files",
                    [info.rank for info in infos])
        return
    handovers.keep_descriptions(folder, infos)


def wrap_initialize(ray_setting: str, handovers: RayHandovers, confirm: str = "board") -> Any:
    """The wrapper of ``Executor.initialize_from_config``: the hand-over first, then vLLM's own call (the
    ranks make and describe their KV caches), then under Ray their descriptions, kept in ``handovers``.
    ``confirm``: ``KVELASTIC_TP_CONFIRM``, told to the ranks with the folder."""
    return functools.partial(_initialize_from_config, ray_setting, handovers, confirm)


def _initialize_from_config(ray_setting: str, handovers: RayHandovers, confirm: str, wrapped: Any, executor: Any,
                            args: tuple, kwargs: dict) -> Any:
    folder = hand_over_folder(executor, ray_setting, handovers, confirm)
    result = wrapped(*args, **kwargs)
    if folder is not None:
        collect_descriptions(executor, folder, handovers)
    return result
