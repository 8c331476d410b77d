"""What a rank tells its scheduler about its KV cache, and how the scheduler reads it back.

A rank's description travels as bounded JSON checked against a fixed schema
when read back (:mod:`kvelastic.shared.bounded_json`), never pickle: it comes
from another process, possibly on another host, and the scheduler plans every
command from it. It carries plain values only; a layout comes back as exactly
the :class:`~kvelastic.pool.kv_layout.KVGroupLayout` the rank built, or not at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvelastic.cluster.device import ACCOUNT_ID
from kvelastic.shared import bounded_json
from kvelastic.shared.bounded_json import expect, int_list
from kvelastic.shared.errors import BadSharedData

MAX_INFO_BYTES = 4 << 20
MAX_WORLD = 4096
MAX_VALUE = 1 << 52  # no offset, size or count a rank describes comes near this
MAX_ENTRIES = 1 << 16  # regions of a layout, runs of a region
#: A host identity as ``rank_handover.host_identity`` spells it (a boot id, "/", a pid namespace's inode).
HOST_ID = re.compile(r"[A-Za-z0-9_.:/-]{1,160}")  # whole names only: fullmatch


@dataclass(frozen=True)
class RankInfo:
    """A rank's description of its KV cache, for the scheduler."""

    rank: int
    world: int
    pid: int
    layout: Any            # the rank's KVGroupLayout (identical on every rank)
    group_bytes: int
    page_bytes: int
    limit_bytes: int | None
    host_slots: int        # 0 without a host tier
    slot_bytes: int
    gpu_id: str = ""       # the rank's device, as its shared account names it ("": not said)
    gpu_total: int = 0     # the device's memory in bytes (0: unknown)
    #: The rank's state before any scheduler existed: the groups it had mapped (vLLM's start-up) and its
    #: applied-command mark, which the scheduler starts from (``kvelastic/tp/start_state.py``).
    start_groups: tuple[int, ...] = ()
    applied: int = 0
    #: The rank's host and pid namespace (``rank_handover.host_identity()``); "" means the engine core's. The
    #: scheduler joins no shared account on its own host for a GPU on another (:mod:`kvelastic.tp.rank_hosts`).
    host: str = ""


_INFO = {"rank": int, "world": int, "pid": int, "group_bytes": int, "page_bytes": int,
         "limit_bytes": (int, type(None)), "host_slots": int, "slot_bytes": int, "layout": dict,
         "gpu_id": str, "gpu_total": int, "start_groups": list, "applied": int}
_LAYOUT = {"num_blocks": int, "page_bytes": int, "blocks_per_group": int, "regions": list}
_REGION = {"region": int, "block_stride": int, "runs": list}


def encode_info(info: RankInfo) -> bytes:
    layout = info.layout
    regions = [{"region": r.region, "block_stride": r.block_stride, "runs": [list(run) for run in r.runs]}
               for r in layout.regions]
    return bounded_json.dumps({
        "rank": info.rank, "world": info.world, "pid": info.pid, "group_bytes": info.group_bytes,
        "page_bytes": info.page_bytes, "limit_bytes": info.limit_bytes, "host_slots": info.host_slots,
        "slot_bytes": info.slot_bytes, "gpu_id": info.gpu_id, "gpu_total": info.gpu_total,
        "start_groups": list(info.start_groups), "applied": info.applied, "host": info.host,
        "layout": {"num_blocks": layout.num_blocks, "page_bytes": layout.page_bytes,
                   "blocks_per_group": layout.blocks_per_group, "regions": regions}})


def decode_info(data: bytes, what: str) -> RankInfo:
    """The RankInfo a rank sent; BadSharedData for anything out of shape, size or range."""
    if len(data) > MAX_INFO_BYTES:
        raise BadSharedData(f"{what} is {len(data)} bytes, more than the {MAX_INFO_BYTES} a description may be")
    record = expect(bounded_json.loads(data, what), _INFO, what)
    _in_range(record["world"], 1, MAX_WORLD + 1, f"{what}: world")
    _in_range(record["rank"], 0, record["world"], f"{what}: rank")
    _in_range(record["pid"], 1, 1 << 31, f"{what}: pid")
    for key in ("group_bytes", "page_bytes"):
        _in_range(record[key], 1, MAX_VALUE, f"{what}: {key}")
    for key in ("host_slots", "slot_bytes"):
        _in_range(record[key], 0, MAX_VALUE, f"{what}: {key}")
    if record["limit_bytes"] is not None:
        _in_range(record["limit_bytes"], 0, MAX_VALUE, f"{what}: limit_bytes")
    _in_range(record["gpu_total"], 0, MAX_VALUE, f"{what}: gpu_total")
    _in_range(record["applied"], 0, MAX_VALUE, f"{what}: applied")
    if record["gpu_id"] and not ACCOUNT_ID.fullmatch(record["gpu_id"]):
        raise BadSharedData(f"{what}: gpu_id {record['gpu_id'][:40]!r} is not an account id")
    layout = _decode_layout(record["layout"], what)
    host = _host(record.get("host", ""), what)
    return RankInfo(rank=record["rank"], world=record["world"], pid=record["pid"],
                    layout=layout, group_bytes=record["group_bytes"],
                    page_bytes=record["page_bytes"], limit_bytes=record["limit_bytes"],
                    host_slots=record["host_slots"], slot_bytes=record["slot_bytes"],
                    gpu_id=record["gpu_id"], gpu_total=record["gpu_total"],
                    start_groups=_start_groups(record["start_groups"], layout.num_groups, what),
                    applied=record["applied"], host=host)


def _host(value: Any, what: str) -> str:
    """The rank's host identity: absent or "" (the engine core's host), else a bounded plain name."""
    if not isinstance(value, str):
        raise BadSharedData(f"{what}: host must be a string, not {type(value).__name__}")
    if value and not HOST_ID.fullmatch(value):
        raise BadSharedData(f"{what}: host {value[:40]!r} is not a host identity")
    return value


def _start_groups(value: list, num_groups: int, what: str) -> tuple[int, ...]:
    """The groups a rank mapped before its scheduler existed: each a group of its layout, none twice."""
    groups = int_list(value, f"{what}: start_groups", high=num_groups, max_len=num_groups)
    if len(set(groups)) != len(groups):
        raise BadSharedData(f"{what}: start_groups names a group twice")
    return tuple(groups)


def _decode_layout(record: dict, what: str) -> Any:
    from kvelastic.pool.kv_layout import BlockRuns, KVGroupLayout

    expect(record, _LAYOUT, f"{what}: layout")
    for key in ("num_blocks", "page_bytes", "blocks_per_group"):
        _in_range(record[key], 1, MAX_VALUE, f"{what}: layout {key}")
    if not 0 < len(record["regions"]) <= MAX_ENTRIES:
        raise BadSharedData(f"{what}: layout has {len(record['regions'])} regions")
    regions = []
    for region in record["regions"]:
        expect(region, _REGION, f"{what}: layout region")
        _in_range(region["region"], 0, MAX_VALUE, f"{what}: region number")
        _in_range(region["block_stride"], 1, MAX_VALUE, f"{what}: block stride")
        if len(region["runs"]) > MAX_ENTRIES:
            raise BadSharedData(f"{what}: a region has {len(region['runs'])} runs")
        runs = tuple(tuple(int_list(run, f"{what}: run", high=MAX_VALUE, max_len=2)) for run in region["runs"])
        if any(len(run) != 2 for run in runs):
            raise BadSharedData(f"{what}: a run is not [start, length]")
        regions.append(BlockRuns(region["region"], region["block_stride"], runs))  # type: ignore[arg-type]
    return KVGroupLayout(regions, record["num_blocks"], record["page_bytes"], record["blocks_per_group"])


def _in_range(value: int, low: int, high: int, what: str) -> None:
    if not low <= value < high:
        raise BadSharedData(f"{what} is {value}, not in [{low}, {high})")
