"""Which worker ranks share the engine core's host: what the GPUs' shared accounts depend on.

A GPU's shared account lives in one host's shared folder. A rank may run on
another host (Ray, or vLLM's multiprocess executor over several nodes); its
description says so (``RankInfo.host``). The scheduler side asks here which
ranks are elsewhere, so that it never counts their GPU in this host's account
of a same-named GPU.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvelastic.tp.rank_info import RankInfo

log = logging.getLogger("vllm.kvelastic")


def on_this_host(info: RankInfo, here: str) -> bool:
    """Whether ``info``'s rank runs on the host (and pid namespace) ``here``; a description that names no host
    is of ``here``."""
    return not info.host or info.host == here


def ranks_elsewhere(infos: Sequence[RankInfo], here: str) -> tuple[int, ...]:
    """The ranks not on ``here``, in rank order."""
    return tuple(info.rank for info in infos if not on_this_host(info, here))


def split_by_host(infos: Sequence[RankInfo], here: str) -> tuple[list[RankInfo], list[RankInfo]]:
    """``infos`` as (the ranks on ``here``, the ranks elsewhere)."""
    local = [info for info in infos if on_this_host(info, here)]
    return local, [info for info in infos if not on_this_host(info, here)]


def report_gpus_left_out(elsewhere: Sequence[RankInfo]) -> None:
    """One log line: the GPUs of ranks on other hosts, which the engine core does not share on its host."""
    if not elsewhere:
        return
    gpus = sorted({f"{info.gpu_id or '?'} (rank {info.rank}, host {info.host})" for info in elsewhere})
    log.warning("kvelastic: GPUs left out of sharing on this host: %s; their ranks run on another host, whose "
                "shared accounts this engine core cannot join; those GPUs serve on this engine's own limit",
                ", ".join(gpus))
