"""The sharing rules, as pure functions over member records (easy to test exhaustively).

Each member is charged ``max(mapped, min)`` against the GPU's budget: what it
holds, or what it has reserved if it holds less, so a reservation stays free
for its owner however hungry the others are.

* **Grant** ``n`` more bytes to member ``m`` iff ``m`` stays within its own cap
  (``max``; 0 means none) and the total charge after the grant is within the
  budget. A grant that does not raise the total (``m`` is still inside its
  reservation) is allowed even while the charge is over budget (a member
  joined with a reservation while the others held the memory), as long as the
  bytes really held stay within the budget: a reservation is a promise, kept
  as soon as the others have given the memory back, never by holding more
  physical bytes than the budget (so the sum of ``mapped`` never passes it,
  however members join).
* **Demand** is the charge that what members want and could not get (refusals
  by the budget, not by their own cap, in the last ``want_ttl_s`` seconds)
  would add, minus the budget's free room; an account over its budget adds the
  excess. A want inside the member's reservation adds no charge: it is
  already counted.
* **Pressure** on a member is its share of the demand, taken only from bytes
  it holds above its reservation that hold cached (reclaimable) data, never
  from a member that is itself waiting. Shares are proportional to each
  donor's reclaimable bytes (rounded up), so every donor gives back at a similar
  rate and no one member's prefix cache is wiped first; if all the donors
  together hold less than the demand, each gives all it can.
* **Fair share.** Every member may borrow the whole budget while the others
  do not need it, but each busy one is promised back an equal part of it
  among the busy members (or its reservation, if larger): :func:`fair_share`.
  Busy means waiting for the budget, or using beyond its cache more than an
  eighth of an equal part among all members (:func:`busy`), so an idle
  member's part goes to those that work. While a member presses for its
  share (:func:`contending`: it waits, or it works and was refused in the last
  ``want_ttl_s``) and holds less than it, every member holding more than its
  own share must shrink to it (:func:`share_cap`), also memory its running
  requests use: the engine stops admitting, and vLLM preempts what does not
  fit, as it would in a static partition of that size. So a model that turns
  busy gets at least what a static split among the busy models would give it,
  within the time its neighbours take to let go, and the memory an idle model
  does not use is never wasted. Above their shares, members are served first
  come.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable

from kvelastic.cluster.records import MemberRecord

DEFAULT_WANT_TTL_S = 5.0


class Verdict(Enum):
    GRANTED = "granted"
    OVER_MAX = "over the member's max"
    OVER_BUDGET = "over the GPU's shared budget"
    BUSY = "the shared account was locked by another process past the deadline"


def charged_total(records: Iterable[MemberRecord]) -> int:
    """Sum of ``max(mapped, min)`` over members: the budget in use or promised."""
    return sum(r.charged_bytes for r in records if r.used)


def mapped_total(records: Iterable[MemberRecord]) -> int:
    """Sum of ``mapped`` over members: the physical bytes held now."""
    return sum(r.mapped_bytes for r in records if r.used)


def judge(records: list[MemberRecord], me: MemberRecord, nbytes: int, budget: int) -> Verdict:
    """May ``me`` take ``nbytes`` more? ``me`` must be one of ``records``."""
    mapped = me.mapped_bytes + nbytes
    if me.max_bytes and mapped > me.max_bytes:
        return Verdict.OVER_MAX
    before = charged_total(records)
    after = before - me.charged_bytes + max(mapped, me.min_bytes)
    if after <= budget or (after <= before and mapped_total(records) + nbytes <= budget):
        return Verdict.GRANTED
    return Verdict.OVER_BUDGET


def added_charge(record: MemberRecord, nbytes: int) -> int:
    """How much granting ``nbytes`` to ``record`` would raise its charge (0 inside its reservation)."""
    return max(record.mapped_bytes + nbytes, record.min_bytes) - record.charged_bytes


def recent(then: float, now: float, ttl_s: float) -> bool:
    """Whether the shared wall-clock time ``then`` lies within ``ttl_s`` of ``now``, in either direction.

    Times in the account are wall-clock times (every process reads them), so
    the age is bounded both ways: after the wall clock steps back, a time
    written before the step lies ahead of ``now`` and lapses at once instead of
    counting for the length of the step; live members write fresh ones within
    a tick.
    """
    return abs(now - then) <= ttl_s


def wanting(record: MemberRecord, now: float, want_ttl_s: float) -> bool:
    """Whether ``record`` was refused by the budget recently enough to still count."""
    return record.used and record.wanted_bytes > 0 and recent(record.wanted_at, now, want_ttl_s)


def demand(records: list[MemberRecord], budget: int, now: float,
           want_ttl_s: float = DEFAULT_WANT_TTL_S) -> int:
    """Bytes the account needs its members to give back now."""
    wanted = sum(added_charge(r, r.wanted_bytes) for r in records if wanting(r, now, want_ttl_s))
    return max(0, wanted + charged_total(records) - budget)


def short_lately(record: MemberRecord, now: float, want_ttl_s: float) -> bool:
    """Whether ``record`` was refused by the budget within ``want_ttl_s``, even if a grant has come since
    (:func:`contending` says why that matters)."""
    return record.used and record.wanted_at > 0 and recent(record.wanted_at, now, want_ttl_s)


def reclaimable(record: MemberRecord) -> int:
    """Cached bytes ``record`` holds above its reservation: what it can give without preempting."""
    return min(record.cached_bytes, max(0, record.mapped_bytes - record.min_bytes))


def pressure(records: list[MemberRecord], me: MemberRecord, budget: int, now: float,
             want_ttl_s: float = DEFAULT_WANT_TTL_S) -> int:
    """Bytes ``me`` should give back now (0 when nobody waits or ``me`` waits itself)."""
    need = demand(records, budget, now, want_ttl_s)
    mine = reclaimable(me)
    if need == 0 or mine == 0 or wanting(me, now, want_ttl_s):
        return 0
    pool = sum(reclaimable(r) for r in records if r.used and not wanting(r, now, want_ttl_s))
    if pool <= need:
        return mine
    return min(mine, -(-need * mine // pool))


def headroom(records: list[MemberRecord], me: MemberRecord, budget: int) -> int:
    """The most ``me`` could be granted right now (every smaller request is granted too)."""
    inside = max(0, me.min_bytes - me.mapped_bytes)  # growth that adds no charge
    charged = charged_total(records)
    if charged <= budget:
        room = inside + budget - charged
    else:
        room = max(0, min(inside, budget - mapped_total(records)))
    if me.max_bytes:
        room = min(room, max(0, me.max_bytes - me.mapped_bytes))
    return room


IDLE_FRACTION = 8  # using less than 1/8 of an equal part (beyond its cache), a member counts as idle


def uses_a_real_part(record: MemberRecord, members: int, budget: int) -> bool:
    """Whether ``record`` uses, beyond its cache, more than an eighth of an equal part of the budget."""
    in_use = max(0, record.mapped_bytes - record.cached_bytes)
    return in_use * IDLE_FRACTION * max(1, members) > budget


def busy(record: MemberRecord, members: int, budget: int, now: float,
         want_ttl_s: float = DEFAULT_WANT_TTL_S) -> bool:
    """Whether ``record`` waits for the budget or uses (beyond its cache) a real part of it."""
    return wanting(record, now, want_ttl_s) or uses_a_real_part(record, members, budget)


def contending(record: MemberRecord, members: int, budget: int, now: float, want_ttl_s: float) -> bool:
    """Whether ``record`` still presses for its fair share: it waits now, or it works and was short lately.

    A working engine's wants are met a group at a time and each grant clears
    the want, so the want alone would lift the others' caps between two groups
    and let the engine above its share take the next group back (on the H100
    the cap came and went within a second, 2026-11-27): for a member that uses
    a real part of the budget, a refusal counts for ``want_ttl_s``
    (:func:`short_lately`). A member that does not (one request on an idle
    model) presses only while it waits, so a neighbour is not held down, and
    its requests preempted, for the seconds after a small want was met.
    """
    return wanting(record, now, want_ttl_s) or (
        short_lately(record, now, want_ttl_s) and uses_a_real_part(record, members, budget))


def fair_share(record: MemberRecord, busy_members: int, budget: int) -> int:
    """The bytes ``record`` is promised back when it waits: an equal part among the busy, or its ``min``."""
    return max(record.min_bytes, budget // max(1, busy_members))


def share_cap(records: list[MemberRecord], me: MemberRecord, budget: int, now: float,
              want_ttl_s: float = DEFAULT_WANT_TTL_S) -> int:
    """The bytes ``me`` must stay within, or shrink to, because another member is short below its fair share.

    0: none. Only a member holding its own share or more is capped, and only at
    that share: it is never pushed below it, so busy members settle at their
    shares at worst; and it does not grow while the other waits, so what it
    gives back goes to the one waiting, not back to itself. Whether the other
    still presses: :func:`contending`.
    """
    live = [r for r in records if r.used]
    working = sum(busy(r, len(live), budget, now, want_ttl_s) for r in live) or len(live)
    mine = fair_share(me, working, budget)
    if me.mapped_bytes < mine:
        return 0
    for other in live:
        if other.slot != me.slot and contending(other, len(live), budget, now, want_ttl_s) and \
                other.mapped_bytes < fair_share(other, working, budget):
            return mine
    return 0
