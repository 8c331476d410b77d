"""The GPUs' shared accounts, as the scheduler of tensor-parallel ranks charges them.

The ranks create pages only on the scheduler's commands, so the scheduler is
each GPU's account member for them: a map is charged to every GPU's account
before it is sent (a refusal by any is a scheduling miss) and an unmap gives
the bytes back. Kept apart from :mod:`kvelastic.tp.remote_mapper`, which calls
these around its commands, so that each module keeps one job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvelastic.cluster.errors import SharedBudgetExceeded
from kvelastic.cluster.ledger import BudgetLedger


@dataclass(frozen=True)
class Charge:
    """One GPU's shared account, as the ranks on it count: a group's bytes there, and how many ranks."""

    ledger: BudgetLedger
    group_bytes: int
    ranks: int = 1

    def bytes_for(self, groups: int, reserve_bytes: int = 0) -> int:
        """``groups`` page groups and a warm reserve of ``reserve_bytes`` per rank, on this GPU."""
        return groups * self.group_bytes + reserve_bytes * self.ranks


def charge_all(charges: Sequence[Charge], groups: int, reserve_bytes: int = 0) -> bool:
    """False if a GPU's shared account refuses ``groups`` more groups (or a rank's warm reserve
    ``reserve_bytes`` more); what the other accounts granted is given back then."""
    done: list[tuple[BudgetLedger, int, bool]] = []
    for charge in charges:
        nbytes = charge.bytes_for(groups, reserve_bytes)
        try:
            done.append((charge.ledger, nbytes, charge.ledger.charge(nbytes)))
        except SharedBudgetExceeded:
            for ledger, taken, _ in done:
                ledger.undo(taken)
            return False
    for ledger, nbytes, granted in done:
        if granted:
            ledger.made(nbytes)
    return True


def release_all(charges: Sequence[Charge], groups: int, reserve_bytes: int = 0) -> None:
    """Give ``groups`` groups (and ``reserve_bytes`` of each rank's warm reserve) back to every account."""
    for charge in charges:
        nbytes = charge.bytes_for(groups, reserve_bytes)
        if nbytes > 0:
            charge.ledger.release(nbytes)
