"""ARC and LRU replacement policies: fidelity to the paper, invariants, pins.

ARC is checked step by step against ``RefARC``, a literal list-based
transcription of the pseudo-code of Megiddo & Modha (FAST '03), so any
departure from the paper shows up as a different hit, victim, ``p`` or list.
"""

from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvelastic.offload.arc import ARC
from kvelastic.offload.lru import LRU
from kvelastic.offload.policy import (
    AllPinnedError,
    EvictionPolicy,
    InvalidCapacityError,
    KeyPinnedError,
    NotPinnedError,
    NotResidentError,
)


class RefARC:
    """ARC(c) straight from the paper; lists hold the LRU key at index 0.

    ``events`` names each case taken, so hand-written streams can prove they
    exercise the case they claim to.
    """

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: list = []
        self.t2: list = []
        self.b1: list = []
        self.b2: list = []
        self.events: list[str] = []
        self.evicted: list = []

    def replace(self, x: object) -> None:
        t1 = len(self.t1)
        if t1 >= 1 and (t1 > self.p or (x in self.b2 and t1 == self.p)):
            if not t1 > self.p:
                self.events.append("REPLACE.tie")
            y = self.t1.pop(0)
            self.b1.append(y)
        else:
            y = self.t2.pop(0)
            self.b2.append(y)
        self.evicted.append(y)

    def request(self, x: object) -> bool:
        c = self.c
        if x in self.t1 or x in self.t2:  # Case I
            (self.t1 if x in self.t1 else self.t2).remove(x)
            self.t2.append(x)
            self.events.append("I")
            return True
        if x in self.b1:  # Case II
            d1 = 1 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(c, self.p + d1)
            self.events.append("II")
            self.replace(x)
            self.b1.remove(x)
            self.t2.append(x)
            return False
        if x in self.b2:  # Case III
            d2 = 1 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(0, self.p - d2)
            self.events.append("III")
            self.replace(x)
            self.b2.remove(x)
            self.t2.append(x)
            return False
        l1 = len(self.t1) + len(self.b1)  # Case IV
        total = l1 + len(self.t2) + len(self.b2)
        if l1 == c:
            if len(self.t1) < c:
                self.events.append("IV.A.replace")
                self.b1.pop(0)
                self.replace(x)
            else:
                self.events.append("IV.A.delete_t1")
                self.evicted.append(self.t1.pop(0))
        elif total >= c:
            if total == 2 * c:
                self.events.append("IV.B.delete_b2")
                self.b2.pop(0)
            else:
                self.events.append("IV.B.replace")
            self.replace(x)
        else:
            self.events.append("IV.B.admit")
        self.t1.append(x)
        return False


def run_against_reference(c: int, stream: list) -> tuple[ARC, RefARC]:
    """Feed ``stream`` to both; assert identical hits, victims, p and lists each step."""
    evicted: list = []
    arc, ref = ARC(c, on_evict=evicted.append), RefARC(c)
    for step, key in enumerate(stream):
        assert arc.request(key) == ref.request(key), f"hit differs at step {step} ({key!r})"
        state = arc.snapshot()
        assert state.p == ref.p, f"p differs at step {step}"
        assert isinstance(state.p, float)
        got = (list(state.t1), list(state.t2), list(state.b1), list(state.b2))
        assert got == (ref.t1, ref.t2, ref.b1, ref.b2), f"lists differ at step {step}"
        assert evicted == ref.evicted, f"victims differ at step {step}"
    return arc, ref


# Shortest streams (found by exhaustive search over the reference) that end in each case.
HAND_STREAMS = [
    ("IV.B.admit", 1, "a"),
    ("I", 1, "aa"),
    ("IV.A.delete_t1", 1, "ab"),
    ("IV.B.replace", 1, "aab"),
    ("III", 1, "aaba"),
    ("II", 1, "aabab"),
    ("IV.A.replace", 1, "aabac"),
    ("IV.B.delete_b2", 1, "aabbc"),
    ("IV.A.delete_t1", 3, "abcd"),
    ("IV.A.replace", 3, "aabcdefg"),
    ("IV.B.delete_b2", 2, "aabbcdacde"),
    ("II", 4, "abcdeabc"),
]


@pytest.mark.parametrize("case, c, stream", HAND_STREAMS)
def test_hand_streams_hit_each_case(case: str, c: int, stream: str) -> None:
    _, ref = run_against_reference(c, list(stream))
    assert case in ref.events


def test_replace_tie_on_b2_hit_takes_t1() -> None:
    # c=2. After "aabbcdacde": p=2, T1=[e], T2=[d], B2=[a, c]. The B2 hit on
    # "a" lowers p to 1 == |T1|, so REPLACE must evict T1's "e", not T2's "d".
    arc, ref = run_against_reference(2, list("aabbcdacdea"))
    assert ref.events[-2:] == ["III", "REPLACE.tie"]
    state = arc.snapshot()
    assert state.p == 1.0 and state.b1 == ("e",) and state.t2 == ("d", "a")
    assert "d" in arc and "e" not in arc


def test_p_adapts_by_real_ratio() -> None:
    # c=4: "abcde" pushes a into B1; "abcde" again gives B1/B2 ghost hits.
    arc, ref = run_against_reference(4, list("aabbccddefghijab"))
    assert any(isinstance(d, float) and d != int(d) for d in [ref.p]) or "II" in ref.events
    assert arc.p == ref.p


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 16).flatmap(
    lambda c: st.tuples(st.just(c), st.lists(st.integers(0, 3 * c), max_size=150))))
def test_matches_reference_on_random_streams(case: tuple[int, list[int]]) -> None:
    c, stream = case
    run_against_reference(c, stream)


# --------------------------------------------------------------- invariants

def check_arc_invariants(arc: ARC) -> None:
    s, c = arc.snapshot(), arc.capacity
    assert len(s.t1) + len(s.b1) <= c
    assert len(s.t1) + len(s.t2) + len(s.b1) + len(s.b2) <= 2 * c
    assert len(s.t1) + len(s.t2) <= c
    assert 0.0 <= s.p <= c
    everything = s.t1 + s.t2 + s.b1 + s.b2
    assert len(set(everything)) == len(everything), "a key sits in two lists"
    assert (arc.t1_size, arc.t2_size, arc.b1_size, arc.b2_size) == tuple(
        map(len, (s.t1, s.t2, s.b1, s.b2)))


OPS = st.lists(st.tuples(st.sampled_from(["req", "req", "req", "rm", "pin", "unpin"]),
                         st.integers(0, 12)), max_size=150)


def apply_ops(policy: EvictionPolicy, evicted: list, ops: list, check: Callable) -> None:
    """Apply random operations, checking the contract (and ``check``) after each."""
    pins: dict[int, int] = {}
    for op, key in ops:
        before, before_state = set(policy.resident_keys()), snapshot_of(policy)
        evicted.clear()
        if op == "req":
            try:
                hit = policy.request(key)
            except AllPinnedError:
                assert len(before) == policy.capacity and len(pins) == policy.capacity
                assert snapshot_of(policy) == before_state and not evicted
                continue
            assert hit == (key in before)
            assert set(evicted) <= before - set(pins), "evicted a pinned or absent key"
            assert len(evicted) <= 1
            assert set(policy.resident_keys()) == (before | {key}) - set(evicted)
        elif op == "rm":
            if key in pins:
                with pytest.raises(KeyPinnedError):
                    policy.remove(key)
            else:
                assert policy.remove(key) == (key in before)
            assert not evicted and key not in policy or key in pins
        elif op == "pin":
            if key in before:
                policy.pin(key)
                pins[key] = pins.get(key, 0) + 1
            else:
                with pytest.raises(NotResidentError):
                    policy.pin(key)
        else:
            if key in pins:
                policy.unpin(key)
                pins[key] -= 1
                if not pins[key]:
                    del pins[key]
            else:
                with pytest.raises(NotPinnedError):
                    policy.unpin(key)
        assert all(k in policy and policy.is_pinned(k) for k in pins)
        assert len(policy) == len(list(policy.resident_keys())) <= policy.capacity
        check(policy)


def snapshot_of(policy: EvictionPolicy) -> object:
    if isinstance(policy, ARC):
        return policy.snapshot()
    return tuple(policy.resident_keys())


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), OPS)
def test_arc_invariants_under_remove_and_pins(c: int, ops: list) -> None:
    evicted: list = []
    apply_ops(ARC(c, on_evict=evicted.append), evicted, ops, check_arc_invariants)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), OPS)
def test_lru_contract_under_remove_and_pins(c: int, ops: list) -> None:
    evicted: list = []
    apply_ops(LRU(c, on_evict=evicted.append), evicted, ops, lambda _: None)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 12), max_size=150))
def test_lru_matches_list_model(c: int, stream: list[int]) -> None:
    evicted: list = []
    lru, model = LRU(c, on_evict=evicted.append), []
    for key in stream:
        hit = key in model
        if hit:
            model.remove(key)
        elif len(model) == c:
            assert lru.request(key) is False and evicted[-1] == model.pop(0)
            model.append(key)
            continue
        model.append(key)
        assert lru.request(key) == hit
        assert list(lru.resident_keys()) == model
