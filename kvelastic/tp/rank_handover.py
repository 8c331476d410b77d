"""A worker rank's side of what it and its engine core hand each other over vLLM's ``collective_rpc``.

A rank meets its scheduler only on vLLM's own calls: the steps carry its
commands, its replies carry its reports, and its description goes back on the
reply to a call the engine core makes once the ranks made their KV caches
(:func:`describe`, kept by :func:`keep_description`). That channel is ordered,
already authenticated by vLLM, and the same on one host or several, so no
rank opens any file of its engine's.

Under vLLM's multiprocess executor the engine core is the rank's parent. A Ray
actor's parent is the raylet, and its environment may come from a Ray cluster
started elsewhere, so under Ray the engine core first tells every rank that it
drives it (:func:`receive`); a Ray rank that was told nothing stops
(:func:`engine_core`) rather than serve a KV cache that no scheduler maps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvelastic.errors import EngineCoreUnknown

if TYPE_CHECKING:
    from kvelastic.tp.rank_info import RankInfo

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

_engine_pid: int | None = None  # the engine core that said it drives this rank (Ray)
_description: "Callable[[], RankInfo] | None" = None  # this rank's description, for describe()


def host_identity() -> str:
    """This machine's boot id and this process's pid namespace: equal only where two processes share a host's
    shared memory and can name each other by pid (the GPUs' shared accounts depend on it)."""
    from kvelastic.cluster.liveness import own_pid_namespace

    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}/{own_pid_namespace()}"


def receive(worker: Any, engine_pid: int) -> tuple[int, str]:
    """Keep the word of the engine core (pid ``engine_pid``) that it drives this rank; runs on each Ray rank
    through ``collective_rpc`` before the rank makes its KV cache. ``worker``: vLLM's, unused. Returns this
    rank's pid and host identity, for the engine core's log."""
    global _engine_pid
    _engine_pid = engine_pid
    return os.getpid(), host_identity()


def engine_core(backend: str) -> int:
    """The pid of the engine core this rank serves under executor ``backend``: its parent under ``mp``, else
    the one that said so (:func:`receive`); EngineCoreUnknown where none did."""
    if backend == "mp":
        return os.getppid()
    if _engine_pid is None:
        raise EngineCoreUnknown(
            f"kvelastic: this worker rank (pid {os.getpid()}) of a {backend!r} executor was told by no engine "
            f"core that it drives it: its parent (pid {os.getppid()}) is not its engine core, and the engine "
            f"core did not say so. kvelastic serves Ray's V2 executor only with kvelastic active in the engine "
            f"core too (KVELASTIC=1 there); otherwise set KVELASTIC=0")
    return _engine_pid


def keep_description(describe_now: "Callable[[], RankInfo]") -> None:
    """Keep how this rank describes itself, for :func:`describe`."""
    global _description
    _description = describe_now


def describe(worker: Any) -> bytes | None:
    """This rank's description as it is now, as bounded JSON, or None where it serves no kvelastic cache; runs
    on each rank through ``collective_rpc`` once vLLM's ``initialize_from_config`` returned (vLLM's warm-up
    over). ``worker``: vLLM's, unused."""
    from kvelastic.tp.rank_info import encode_info

    return None if _description is None else encode_info(_description())


def forget() -> None:
    """Drop the engine core's word and the description kept (a worker whose engine shut down; tests)."""
    global _engine_pid, _description
    _engine_pid = None
    _description = None
