"""Where a worker rank finds its engine's folder: from its parent (multiprocess) or the engine core's word (Ray).

Under vLLM's multiprocess executor the engine core is the rank's parent, so
the folder is named from ``os.getppid()``, as it always was. A Ray actor's
parent is the raylet, so under Ray (V2 executor, one host) the engine core
hands every rank its folder and pid over vLLM's own ``collective_rpc`` before
the ranks initialise their KV caches (``kvelastic.patches.engine_folder_handover``).
That channel is the one every step travels on: ordered, already authenticated
by vLLM, and independent of which environment a Ray cluster started elsewhere
passes on to its actors. :func:`receive` runs on the rank; it refuses a folder
the rank's own settings would put elsewhere, and an engine core on another
machine or pid namespace (the folder lives in that host's shared memory) unless
the engine core confirms on the steps' replies (``KVELASTIC_TP_CONFIRM=step``):
then such a rank runs with no folder at all (:class:`EngineFolder` with
``folder`` None): its board stays in its memory, it writes no file, and its
description, confirmations and commands travel only on vLLM's calls. Once
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
    """The engine's folder and the engine core's pid, as one rank found them. ``folder`` None: the rank is on
    another host than its engine core, which confirms on the steps' replies, so it meets it in no folder."""

    folder: Path | None
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


def receive(worker: Any, folder: str, engine_pid: int, host: str, confirm: str = "board") -> tuple[int, str]:
    """Keep the folder the engine core handed over; runs on each rank through ``collective_rpc``.

    ``worker`` is whatever vLLM passes a callable first (its worker wrapper), unused. ``host``: the engine
    core's :func:`host_identity`; ``confirm``: its ``KVELASTIC_TP_CONFIRM``. Returns this rank's pid and host
    identity, for the engine core (which ranks are elsewhere, its log). On another host or pid namespace the
    rank runs with no folder if ``confirm`` is ``step`` (nothing it needs goes through one there), else
    EngineFolderError; EngineFolderError too if this rank's ``KVELASTIC_SHARED_DIR``/``KVELASTIC_SHARED_GROUP``
    name another folder than the engine core's.
    """
    global _handed
    from kvelastic.tp.board import engine_dir
    from kvelastic.tp.remote_mapper import STEP

    here = host_identity()
    if host != here:
        if confirm != STEP:
            raise EngineFolderError(
                f"kvelastic: this worker rank (pid {os.getpid()}, host {here}) is not on the engine core's host "
                f"and pid namespace ({host}), and with KVELASTIC_TP_CONFIRM={confirm} the ranks meet their "
                f"scheduler in shared memory on one host. Set KVELASTIC_TP_CONFIRM=auto (the default) or step "
                f"(a rank on another host then runs with no folder), run the engine on one node (a Ray placement "
                f"group on the engine core's node), or set KVELASTIC=0")
        _handed = EngineFolder(None, engine_pid)  # the engine core's pid names nothing on this host
        return os.getpid(), here
    expected = engine_dir(engine_pid)
    if Path(folder) != expected:
        raise EngineFolderError(
            f"kvelastic: the engine core (pid {engine_pid}) keeps its folder at {folder}, but this rank's "
            f"settings name {expected}: give every process of the engine the same KVELASTIC_SHARED_DIR "
            f"and KVELASTIC_SHARED_GROUP (a Ray cluster started elsewhere passes on its own environment)")
    _handed = EngineFolder(expected, engine_pid)
    return os.getpid(), here


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
