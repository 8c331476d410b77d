"""What ``kvelastic status`` and ``kvelastic top`` show: the accounts as data, and as a table.

The data (:func:`snapshot`) is what ``status --json`` prints: each account's
budget and usage, and each live member with the engine numbers its metrics
snapshot adds. The table and the row of one member are shared by ``status``
and the live view.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from kvelastic.cluster import MemberInfo, SharedAccount
from kvelastic.cluster.account import LEASE_S
from kvelastic.cluster.liveness import own_pid_namespace
from kvelastic.metrics.metrics import find_snapshot
from kvelastic.shared.errors import SharedFileError
from kvelastic.shared.text import printable
from kvelastic.units import format_size

#: Engine numbers copied from the instance's metrics snapshot into ``status --json`` when present.
ENGINE_KEYS = ("spilled_bytes", "reloaded_bytes", "host_bytes_used", "limit_bytes")


def snapshot(accounts: list[SharedAccount]) -> list[dict]:
    """One JSON-ready dict per account: GPU, budget, usage and live members."""
    result = []
    for account in accounts:
        members = account.members()
        charged = sum(m.charged_bytes for m in members)
        listed = [{**m.as_dict(), **engine_numbers(account.path.parent, m)} for m in members]
        result.append({"gpu": account.gpu_id, "path": str(account.path), "budget_bytes": account.budget,
                       "charged_bytes": charged, "mapped_bytes": sum(m.mapped_bytes for m in members),
                       "members": listed})
    return result


def engine_numbers(directory: Path, member: MemberInfo) -> dict[str, int]:
    """The ``ENGINE_KEYS`` of the member's metrics snapshot, or nothing where it has none.

    The account only holds what the grants need; the host tier's traffic and
    the limit the pool enforces live in the snapshot each engine rewrites on
    every upkeep tick for ``/metrics`` (:mod:`kvelastic.metrics.metrics`).
    It must carry the engine's pid and the member's name, so a stale file of an
    earlier process is never shown.
    """
    try:
        record = find_snapshot(directory, member.pid, member.name, member.pid_ns)
    except (SharedFileError, OSError):
        return {}
    if record is None:
        return {}
    values = record["values"]  # checked: finite numbers only
    return {k: int(values[k]) for k in ENGINE_KEYS if k in values}


COLUMNS = ("INSTANCE", "PID", "MODEL", "PORT", "MAPPED", "CACHED", "HOST", "MIN", "MAX", "WANTED", "SEEN")


def short(text: str, width: int = 32) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3):]


def member_row(m: MemberInfo, now: float) -> tuple[str, ...]:
    size = format_size
    pid = f"{m.pid}*" if m.pid_ns != own_pid_namespace() else str(m.pid)
    return (printable(m.name), pid, printable(short(m.model)) or "-", str(m.port) if m.port else "-",
            size(m.mapped_bytes), size(m.cached_bytes), size(m.host_bytes),
            size(m.min_bytes) if m.min_bytes else "-", size(m.max_bytes) if m.max_bytes else "none",
            size(m.wanted_bytes) if m.wanted_bytes else "-", f"{max(0.0, now - m.heartbeat):.0f}s ago")


def member_of(data: dict) -> MemberInfo:
    """The MemberInfo inside one ``status --json`` member dict (which also holds engine numbers)."""
    return MemberInfo(**{f.name: data[f.name] for f in dataclasses.fields(MemberInfo) if f.name in data})


def render_table(accounts: list[dict], now: float | None = None) -> str:
    """The human status text: a heading per GPU, then an aligned row per instance."""
    now = time.time() if now is None else now
    lines = []
    elsewhere = False
    for acct in accounts:
        if "error" in acct:
            fix = "try again (a stopped instance holds it?)" if acct["busy"] else f"`kvelastic reset {acct['gpu']}`"
            lines.append(f"GPU {acct['gpu']}: cannot read its account {acct['path']}: {acct['error']}; {fix}")
            continue
        budget, charged = acct["budget_bytes"], acct["charged_bytes"]
        share = 100.0 * charged / budget if budget else 0.0
        lines.append(f"GPU {printable(acct['gpu'])}: budget {format_size(budget)}, in use or reserved "
                     f"{format_size(charged)} ({share:.0f}%), free {format_size(max(0, budget - charged))}")
        rows = [member_row(member_of(m), now) for m in acct["members"]]
        if not rows:
            lines.append("  (no live instances)")
            continue
        elsewhere |= any(row[1].endswith("*") for row in rows)
        widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
        for row in [COLUMNS, *rows]:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if elsewhere:
        lines.append(f"* in another pid namespace: pruned once silent for {LEASE_S:g} s (SEEN)")
    return "\n".join(lines)
