"""Read-only views handed out by the account: a member's state, and one tick's answer."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvelastic.cluster import policy
from kvelastic.cluster.records import MemberRecord


@dataclass(frozen=True)
class MemberInfo:
    """A read-only view of one live member, for status displays and scripts."""

    name: str
    pid: int
    model: str
    port: int
    min_bytes: int
    max_bytes: int
    mapped_bytes: int
    cached_bytes: int
    host_bytes: int
    wanted_bytes: int
    heartbeat: float
    joined_at: float
    start_max_bytes: int = 0  # the cap it joined with (0: none); `kvelastic limit NAME none` restores it
    pid_ns: int = 0  # its pid namespace (inode of /proc/<pid>/ns/pid): its pid means nothing in another one
    waiting_since: float | None = None  # Unix time its current run of budget refusals began; None: not waiting

    @classmethod
    def of(cls, record: MemberRecord, now: float, want_ttl_s: float) -> "MemberInfo":
        """The view of ``record`` at ``now``: a wait shows only while its want counts for the others."""
        waiting = policy.wanting(record, now, want_ttl_s) and record.waiting_since > 0
        return cls(name=record.name, pid=record.pid, model=record.model, port=record.port,
                   min_bytes=record.min_bytes, max_bytes=record.max_bytes,
                   mapped_bytes=record.mapped_bytes, cached_bytes=record.cached_bytes,
                   host_bytes=record.host_bytes, wanted_bytes=record.wanted_bytes,
                   heartbeat=record.heartbeat, joined_at=record.joined_at,
                   start_max_bytes=record.start_max_bytes, pid_ns=record.pid_ns,
                   waiting_since=record.waiting_since if waiting else None)

    @property
    def charged_bytes(self) -> int:
        """What the member counts against the budget: its holdings or its reservation."""
        return max(self.mapped_bytes, self.min_bytes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MemberTick:
    """What a member learns on one upkeep tick (see :meth:`Member.tick`).

    ``max_bytes`` 0 means no cap of its own; ``pressure_bytes`` is what it
    should give back now (cached bytes above its reservation) because others
    wait for memory; ``share_cap_bytes`` (0: none) is what it must shrink to,
    running requests included, because another member waits below its fair
    share (:func:`kvelastic.cluster.policy.share_cap`).
    """

    min_bytes: int
    max_bytes: int
    pressure_bytes: int
    budget_bytes: int
    share_cap_bytes: int = 0
