"""Where a worker rank finds its engine's folder: from its parent (multiprocess) or the engine core's word (Ray).

Under vLLM's multiprocess executor the engine core is the rank's parent, so
the folder is named from ``os.getppid()``, as it always was. A Ray actor's
parent is the raylet, so under Ray (V2 executor, one host) the engine core
hands every rank its folder and pid over vLLM's own ``collective_rpc`` before
the ranks initialise their KV caches (``kvelastic.patches.engine_folder_handover``).
That channel is the one every step travels on: ordered, already authenticated
by vLLM, and independent of which environment a Ray cluster started elsewhere
passes on to its actors. :func:`receive` runs on the rank; it refuses an engine
core on another machine or pid namespace (the folder lives in this host's
shared memory) and a folder the rank's own settings would put elsewhere. Once
vLLM's call returned (the ranks made their KV caches), the engine core asks
each rank for its description the same way (:func:`describe`), so the
scheduler reads it from the replies rather than from ``rank<r>.info``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvelastic.errors import EngineFolderError

if TYPE_CHECKING:
    from kvelastic.tp.rank_files import RankInfo

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class EngineFolder:
    """The engine's folder and the engine core's pid, as one rank found them."""

    folder: Path
    engine_pid: int


_handed: EngineFolder | None = None
_description: bytes | None = None  # this rank's description, as its rank<r>.info holds it


def host_identity() -> str:
    """This machine's boot id and this process's pid namespace: equal only where a process can both
    open the same ``/dev/shm`` folder and name the engine core by its pid."""
    from kvelastic.cluster.liveness import own_pid_namespace

    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}/{own_pid_namespace()}"


def receive(worker: Any, folder: str, engine_pid: int, host: str) -> int:
    """Keep the folder the engine core handed over; runs on each rank through ``collective_rpc``.

    ``worker`` is whatever vLLM passes a callable first (its worker wrapper), unused. Returns this
    rank's pid, for the engine core's log. EngineFolderError if the engine core is on another host or
    pid namespace, or if this rank's ``KVELASTIC_SHARED_DIR``/``KVELASTIC_SHARED_GROUP`` name another folder.
    """
    global _handed
    from kvelastic.tp.board import engine_dir

    here = host_identity()
    if host != here:
        raise EngineFolderError(
            f"kvelastic: this worker rank (pid {os.getpid()}, host {here}) is not on the engine core's host "
            f"and pid namespace ({host}): the ranks meet their scheduler in shared memory on one host. Run "
            f"the engine on one node (a Ray placement group on the engine core's node), or set KVELASTIC=0")
    expected = engine_dir(engine_pid)
    if Path(folder) != expected:
        raise EngineFolderError(
            f"kvelastic: the engine core (pid {engine_pid}) keeps its folder at {folder}, but this rank's "
            f"settings name {expected}: give every process of the engine the same KVELASTIC_SHARED_DIR "
            f"and KVELASTIC_SHARED_GROUP (a Ray cluster started elsewhere passes on its own environment)")
    _handed = EngineFolder(expected, engine_pid)
    return os.getpid()


def rank_folder(backend: str) -> EngineFolder:
    """This rank's engine folder under executor ``backend``: its parent's under ``mp``, else the one
    handed over; EngineFolderError where none was (the rank's parent is not its engine core)."""
    if backend == "mp":
        from kvelastic.tp.board import engine_dir

        parent = os.getppid()
        return EngineFolder(engine_dir(parent), parent)
    if _handed is None:
        raise EngineFolderError(
            f"kvelastic: this worker rank (pid {os.getpid()}) of a {backend!r} executor was handed no "
            f"engine folder: its parent (pid {os.getppid()}) is not its engine core, and the engine core "
            f"did not say where its folder is. kvelastic hands it over only on Ray's V2 executor with "
            f"KVELASTIC_RAY=allow and kvelastic active in the engine core (KVELASTIC=1 there too); "
            f"otherwise set KVELASTIC=0")
    return _handed


def keep_description(info: "RankInfo") -> None:
    """Keep this rank's description (written to its ``rank<r>.info`` too) for :func:`describe`."""
    global _description
    from kvelastic.tp.rank_files import encode_info

    _description = encode_info(info)


def describe(worker: Any) -> bytes | None:
    """This rank's description, as bounded JSON (what its ``rank<r>.info`` holds), or None where it serves
    no kvelastic cache; runs on each rank through ``collective_rpc`` once vLLM's ``initialize_from_config``
    returned. ``worker``: vLLM's, unused."""
    return _description


def forget() -> None:
    """Drop a folder handed over and the description kept (a worker whose engine shut down; tests)."""
    global _handed, _description
    _handed = None
    _description = None
