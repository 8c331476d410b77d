"""Copies stored ahead ("resident, not yet requested"): the policy never sees them until an eviction.

The property: a tier with write-through (``c + r`` slots, ``r`` of them for
copies made ahead) and a tier without it (``c`` slots) driven by the same GPU
evictions and lookups make the same requests to their policies, so ARC's lists
and ``p`` (and LRU's order), hits and misses are equal step for step, whatever
is stored ahead in between. And no slot is ever given to two keys.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvelastic.offload.arc import ARC
from kvelastic.offload.host_tier import HostTier
from kvelastic.offload.store_ahead import AheadCopies
from kvelastic.offload.write_through import ahead_slots

SLOT = 64
OPS = st.lists(st.tuples(st.sampled_from(["ahead", "ahead", "evict", "evict", "lookup", "drop"]),
                         st.integers(0, 20)), max_size=200)


def _state(tier: HostTier) -> object:
    p = tier.policy
    return p.snapshot() if isinstance(p, ARC) else tuple(p.resident_keys())


def _check_slots(tier: HostTier, ahead: AheadCopies) -> None:
    held = [tier._slot_of[k] for k in tier.policy.resident_keys()]
    extra = list(ahead._slot_of.values())
    taken = held + extra
    assert len(set(taken)) == len(taken), "one slot holds two keys"
    assert not set(taken) & set(tier._free), "a slot in use is also free"
    assert len(taken) + len(tier._free) == tier.slots
    assert not set(ahead._slot_of) & set(tier.policy.resident_keys())


@pytest.mark.parametrize("policy", ["arc", "lru"])
@settings(max_examples=400, deadline=None)
@given(c=st.integers(1, 8), r=st.integers(1, 6), ops=OPS)
def test_write_through_leaves_the_policy_as_eviction_alone_would(policy: str, c: int, r: int, ops: list) -> None:
    plain = HostTier(c * SLOT, SLOT, pin=False, policy=policy)
    tier = HostTier((c + r) * SLOT, SLOT, pin=False, policy=policy, ahead_slots=r)
    ahead = AheadCopies(tier)
    block = 0
    for op, key in ops:
        if op == "ahead":  # the block computed under ``key`` is stored ahead (no request)
            if ahead.wants(key):
                block += 1
                ahead.place(key, block)
        elif op == "evict":  # a block holding ``key`` leaves the GPU
            plain.admit(key)
            if not ahead.promote(key):
                tier.admit(key)
        elif op == "lookup":
            assert (plain.lookup(key) is None) == (tier.lookup(key) is None)
        elif ahead.key_of_block(key) is not None:  # vLLM dropped block ``key``'s hash
            ahead.forget_block(key)
        assert _state(plain) == _state(tier)
        assert (plain.hits, plain.misses, plain.admitted, plain.evicted) == \
            (tier.hits, tier.misses, tier.admitted, tier.evicted)
        _check_slots(tier, ahead)


def test_a_copy_made_ahead_is_not_a_request_and_its_eviction_is_a_miss_not_a_hit():
    tier = HostTier(4 * SLOT, SLOT, pin=False, ahead_slots=2)
    ahead = AheadCopies(tier)
    slot = ahead.place("k", block_id=7)
    assert slot is not None and "k" in ahead and "k" not in tier and len(tier.policy) == 0
    assert tier.lookup("k") is None  # nothing is served from a copy the policy has not admitted
    assert ahead.promote("k") and "k" in tier and "k" not in ahead
    arc = tier.policy
    assert isinstance(arc, ARC) and arc.snapshot().t1 == ("k",) and arc.snapshot().t2 == ()  # admitted in T1
    assert tier.lookup("k") == slot and tier.hits == 1  # the copy made ahead is what a load reads


def test_the_policy_takes_back_the_oldest_copy_made_ahead_when_short_of_slots():
    tier = HostTier(3 * SLOT, SLOT, pin=False, ahead_slots=1)  # the policy manages 2
    ahead = AheadCopies(tier)
    assert [ahead.place(k, i) for i, k in enumerate("abc")] == [0, 1, 2]  # the policy's free slots too
    assert ahead.place("d", 9) is None  # no free slot: no copy (none is dropped for it)
    assert tier.admit("x") == 0 and "a" not in ahead and ahead.dropped == 1
    assert tier.admit("y") == 1 and list(ahead._slot_of) == ["c"]
    tier.admit("z")  # the policy is full: it evicts one of its own, the last copy made ahead stays
    assert "c" in ahead and tier.evicted == 1


def test_a_rehashed_block_drops_its_stale_copy_and_a_reset_frees_everything():
    tier = HostTier(4 * SLOT, SLOT, pin=False, ahead_slots=2)
    ahead = AheadCopies(tier)
    ahead.place("old", 1)
    ahead.place("new", 1)  # block 1 now holds another key
    assert "old" not in ahead and "new" in ahead and ahead.key_of_block(1) == "new"
    assert tier.stats().slots_used == 1
    tier.clear()
    ahead.clear()
    assert tier.stats().slots_used == 0 and len(ahead) == 0 and tier.policy.capacity == 2


def test_a_quarter_of_the_tier_is_kept_for_copies_made_ahead_leaving_the_policy_one_at_least():
    assert ahead_slots(100) == 25
    assert ahead_slots(3) == 0 and ahead_slots(1) == 0
    assert all(0 <= ahead_slots(n) < n for n in range(1, 50))
    with pytest.raises(ValueError, match="must leave the host tier's policy at least one"):
        HostTier(2 * SLOT, SLOT, pin=False, ahead_slots=2)
