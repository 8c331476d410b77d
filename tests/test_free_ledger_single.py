"""The free-block ledger's one-block paths (a load from the host tier takes and frees one block, thousands
of times a step) keep exactly the books of the list paths they stand in for."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvelastic.scheduler.free_ledger import FreeBlockLedger

PER_GROUP = 4
GROUPS = 6


class Layout:
    """Six groups of four blocks; itself its own ``layout`` (as the scheduler caches hold one)."""

    blocks_per_group = PER_GROUP
    num_groups = GROUPS

    @property
    def layout(self) -> "Layout":
        return self

    def group_of_block(self, block_id: int) -> int:
        return block_id // PER_GROUP

    def blocks_of_group(self, group: int) -> range:
        return range(group * PER_GROUP, (group + 1) * PER_GROUP)


def make_ledger() -> tuple[FreeBlockLedger, list[SimpleNamespace]]:
    blocks = [SimpleNamespace(block_id=i, block_hash=None, prev_free_block=None, next_free_block=None)
              for i in range(GROUPS * PER_GROUP)]
    mapped = {0, 1, 2, 3}
    ledger = FreeBlockLedger(Layout(), blocks, blocks[1:], lambda g: g in mapped, keep_order=True)
    return ledger, blocks


def books(ledger: FreeBlockLedger) -> tuple:
    """Everything the ledger keeps, as plain values."""
    return (list(ledger.in_use), list(ledger.cached_count), list(ledger.last_used), sorted(ledger.empty),
            {g: sorted(m) for g, m in ledger._free_uncached.items()}, ledger._free_uncached_total,
            list(ledger._cached), sorted(ledger._open), ledger.num_in_use, ledger.free_in_mapped,
            [b.block_id for b in ledger.order])


def _reference_lru_victim(ledger: FreeBlockLedger, protected: set[int]):
    """The least recently used cached block not in ``protected``, read without taking it."""
    return next((b for b in ledger._cached.values() if b.block_id not in protected), None)


@pytest.mark.parametrize("seed", range(8))
def test_one_block_paths_keep_the_same_books_as_the_list_paths(seed):
    rng = random.Random(seed)
    one, one_blocks = make_ledger()
    many, many_blocks = make_ledger()
    held: list[int] = []  # ids in use, the same in both
    for step in range(400):
        action = rng.choice(["take", "take", "victim", "free", "free"])
        if action == "take":
            a = one.take_one_uncached()
            got: list = []
            many.take_uncached(1, got)
            assert (a is None) == (not got)
            if a is None:
                continue
            assert a.block_id == got[0].block_id
            one.mark_one_taken(a)
            many.mark_taken(got, now=None)
            held.append(a.block_id)
        elif action == "victim":
            protected = set(rng.sample(range(GROUPS * PER_GROUP), 6))
            expected = _reference_lru_victim(one, protected)
            a, b = one.lru_victim(protected), many.lru_victim(protected)
            assert (a and a.block_id) == (b and b.block_id) == (expected and expected.block_id)
            if a is None:
                continue
            for blocks in (one_blocks, many_blocks):
                blocks[a.block_id].block_hash = None
            one.mark_one_taken(a)
            many.mark_taken([b], now=None)
            held.append(a.block_id)
        elif held:
            block_id = held.pop(rng.randrange(len(held)))
            cached = rng.random() < 0.6
            for blocks in (one_blocks, many_blocks):
                blocks[block_id].block_hash = f"h{step}" if cached else None
            one.mark_one_freed(one_blocks[block_id], float(step))
            many.mark_freed([many_blocks[block_id]], float(step))
        assert books(one) == books(many)
    assert held or one.num_in_use == 1  # the null block's group: block 0 stays in use throughout


def test_no_victim_when_every_cached_block_is_protected_or_none_is_cached():
    ledger, blocks = make_ledger()
    assert ledger.lru_victim(set()) is None
    taken = ledger.take_one_uncached()
    ledger.mark_one_taken(taken)
    taken.block_hash = "a"
    ledger.mark_one_freed(taken, 1.0)
    assert ledger.lru_victim({taken.block_id}) is None
    assert ledger.lru_victim(set()) is taken
    assert ledger.cached_count[taken.block_id // PER_GROUP] == 0
