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

from kvelastic.offload.arc import ARC, ARCState
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
            self.events.append("II" if self.p + d1 <= c else "II.capped")
            self.p = min(c, self.p + d1)
            self.replace(x)
            self.b1.remove(x)
            self.t2.append(x)
            return False
        if x in self.b2:  # Case III
            d2 = 1 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.events.append("III" if self.p - d2 >= 0 else "III.floored")
            self.p = max(0, self.p - d2)
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


# Short streams (most found by exhaustive search over RefARC) whose last request
# takes the named case; the reference's event log proves it.
HAND_STREAMS = [
    ("IV.B.admit", 1, "a"),
    ("I", 1, "aa"),
    ("IV.A.delete_t1", 1, "ab"),
    ("IV.B.replace", 1, "aab"),
    ("III.floored", 1, "aaba"),
    ("II", 1, "aabab"),
    ("IV.A.replace", 1, "aabac"),
    ("IV.B.delete_b2", 1, "aabbc"),
    ("IV.A.delete_t1", 3, "abcd"),
    ("IV.A.replace", 3, "aabcdefg"),
    ("IV.B.delete_b2", 2, "aabbcdacde"),
    ("II", 4, "aabcdeb"),
    ("II.capped", 3, "edcceadbfadb"),
    ("III.floored", 4, "abddfgafecd"),
]


@pytest.mark.parametrize("case, c, stream", HAND_STREAMS)
def test_hand_streams_hit_each_case(case: str, c: int, stream: str) -> None:
    _, ref = run_against_reference(c, list(stream))
    assert ref.events[-1] == case


def test_replace_tie_on_b2_hit_takes_t1() -> None:
    # c=2. After "aabbcdacde": p=2, T1=[e], T2=[d], B2=[a, c]. The B2 hit on
    # "a" lowers p to 1 == |T1|, so REPLACE must evict T1's "e", not T2's "d".
    arc, ref = run_against_reference(2, list("aabbcdacdea"))
    assert ref.events[-2:] == ["III", "REPLACE.tie"]
    state = arc.snapshot()
    assert state.p == 1.0 and state.b1 == ("e",) and state.t2 == ("d", "a")
    assert "d" in arc and "e" not in arc


def test_p_adapts_by_real_division() -> None:
    # c=5: the final "c" is a B1 hit with |B1|=2, |B2|=3, so delta1 = 1.5.
    arc, ref = run_against_reference(5, list("falgcgkldafikhec"))
    assert ref.events[-1] == "II" and arc.p == 3.5


@st.composite
def capacity_and_stream(draw: st.DrawFn) -> tuple[int, list[int]]:
    """A capacity and a stream over an alphabet of 1..3c+1 keys, so hits and
    ghost hits of both kinds are common."""
    c = draw(st.integers(1, 16))
    alphabet = draw(st.integers(1, 3 * c + 1))
    return c, draw(st.lists(st.integers(0, alphabet - 1), max_size=200))


@settings(max_examples=1500, deadline=None)
@given(capacity_and_stream())
def test_matches_reference_on_random_streams(case: tuple[int, list[int]]) -> None:
    run_against_reference(*case)


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
        # Every key in ``pins`` is resident, so the policy must refuse exactly when full of pins.
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
            assert len(evicted) == (not hit and len(before) == policy.capacity)
            assert set(policy.resident_keys()) == (before | {key}) - set(evicted)
        elif op == "rm":
            if key in pins:
                with pytest.raises(KeyPinnedError):
                    policy.remove(key)
            else:
                assert policy.remove(key) == (key in before)
            assert not evicted
            assert (key in policy) == (key in pins)
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
        assert all(policy.is_pinned(k) == (k in pins) for k in range(13))
        assert all(k in policy for k in pins)
        assert len(policy) == len(list(policy.resident_keys())) <= policy.capacity
        check(policy)


def snapshot_of(policy: EvictionPolicy) -> object:
    return policy.snapshot() if isinstance(policy, ARC) else tuple(policy.resident_keys())


@settings(max_examples=1000, deadline=None)
@given(st.integers(1, 8), OPS)
def test_arc_invariants_under_remove_and_pins(c: int, ops: list) -> None:
    evicted: list = []
    apply_ops(ARC(c, on_evict=evicted.append), evicted, ops, check_arc_invariants)


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 8), OPS)
def test_lru_contract_under_remove_and_pins(c: int, ops: list) -> None:
    evicted: list = []
    apply_ops(LRU(c, on_evict=evicted.append), evicted, ops, lambda _: None)


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 12), max_size=150))
def test_lru_matches_list_model(c: int, stream: list[int]) -> None:
    evicted: list = []
    lru, model = LRU(c, on_evict=evicted.append), []
    for key in stream:
        expected_victims = list(evicted)
        hit = key in model
        if hit:
            model.remove(key)
        elif len(model) == c:
            expected_victims.append(model.pop(0))
        model.append(key)
        assert lru.request(key) == hit
        assert list(lru.resident_keys()) == model and evicted == expected_victims


# ----------------------------------------------------------- scan resistance

def count_hits(policy: EvictionPolicy, keys: range) -> int:
    return sum(policy.request(k) for k in keys)


@pytest.mark.parametrize("make, expected_hits", [(ARC, 50), (LRU, 0)])
def test_scan_resistance(make: Callable[[int], EvictionPolicy], expected_hits: int) -> None:
    policy, hot = make(100), range(50)
    for _ in range(3):
        count_hits(policy, hot)
    assert count_hits(policy, range(1000, 1300)) == 0  # one-time scan of 3c new keys
    assert count_hits(policy, hot) == expected_hits


# ------------------------------------------------------------- ARC extras

def arc_after(c: int, stream: str) -> tuple[ARC, list]:
    evicted: list = []
    arc = ARC(c, on_evict=evicted.append)
    for key in stream:
        arc.request(key)
    evicted.clear()
    return arc, evicted


def test_arc_residency_ignores_ghosts() -> None:
    arc, _ = arc_after(2, "aabc")  # T1=[c], T2=[a], B1=[b]
    assert arc.snapshot().b1 == ("b",)
    assert "b" not in arc and not arc.peek("b") and len(arc) == 2
    assert sorted(arc.resident_keys()) == ["a", "c"]


def test_arc_peek_changes_nothing() -> None:
    arc, _ = arc_after(2, "ab")
    before = arc.snapshot()
    assert arc.peek("a") and not arc.peek("z")
    assert arc.snapshot() == before


def test_arc_pin_skips_lru_within_chosen_list() -> None:
    arc, evicted = arc_after(3, "aabc")  # T1=[b, c], T2=[a]; paper evicts b
    arc.pin("b")
    arc.request("d")
    assert evicted == ["c"]
    assert arc.snapshot().t1 == ("b", "d") and arc.snapshot().b1 == ("c",)


def test_arc_pin_falls_back_to_other_list() -> None:
    arc, evicted = arc_after(2, "aab")  # T1=[b], T2=[a]; paper evicts b
    arc.pin("b")
    arc.request("c")
    s = arc.snapshot()
    assert evicted == ["a"] and s.t1 == ("b", "c") and s.b2 == ("a",) and not s.b1


def test_arc_pin_in_case_iv_a_real_eviction() -> None:
    arc, evicted = arc_after(3, "abc")  # |T1| == c, B1 empty: evict T1's LRU, no ghost
    arc.pin("a")
    arc.request("d")
    s = arc.snapshot()
    assert evicted == ["b"] and s.t1 == ("a", "c", "d") and not s.b1


@pytest.mark.parametrize("key", ["z", "c", "a"])  # new key, B1 ghost, B2 ghost
def test_arc_all_pinned_leaves_state_unchanged(key: str) -> None:
    arc, evicted = arc_after(2, "aabbcd")  # T1=[d], T2=[b], B1=[c], B2=[a]
    assert arc.snapshot() == ARCState(0.0, ("d",), ("b",), ("c",), ("a",))
    arc.pin("d")
    arc.pin("b")
    with pytest.raises(AllPinnedError):
        arc.request(key)
    assert arc.snapshot() == ARCState(0.0, ("d",), ("b",), ("c",), ("a",)) and not evicted
    arc.unpin("b")
    assert arc.request(key) is False and evicted == ["b"] and "d" in arc


def test_arc_remove_makes_no_ghost_and_ghosts_stay_valid() -> None:
    arc, evicted = arc_after(2, "aabc")  # T1=[c], T2=[a], B1=[b]
    assert arc.remove("c") and not arc.remove("c")
    assert arc.snapshot().b1 == ("b",) and "c" not in arc.snapshot().b1
    assert arc.request("b") is False  # B1 ghost hit with a free frame: no eviction
    s = arc.snapshot()
    assert s.p == 1.0 and s.t2 == ("a", "b") and not s.t1 and not s.b1 and not evicted


def test_arc_b2_ghost_hit_with_free_frame_evicts_nothing() -> None:
    arc, evicted = arc_after(2, "aabbc")  # T1=[c], T2=[b], B2=[a]
    assert arc.snapshot().b2 == ("a",)
    assert arc.remove("b")
    assert arc.request("a") is False and not evicted
    assert arc.snapshot() == ARCState(0.0, ("c",), ("a",), (), ())


def test_arc_none_is_a_valid_key() -> None:
    arc, evicted = arc_after(1, "")
    arc.request(None)
    arc.request(0)
    assert evicted == [None] and 0 in arc


# ------------------------------------------------------- shared interface

POLICIES = [ARC, LRU]


@pytest.mark.parametrize("make", POLICIES)
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_rejects_bad_capacity(make: Callable, bad: object) -> None:
    with pytest.raises(InvalidCapacityError) as raised:
        make(bad)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("make", POLICIES)
def test_interface_basics(make: Callable[..., EvictionPolicy]) -> None:
    evicted: list = []
    policy = make(2, on_evict=evicted.append)
    assert isinstance(policy, EvictionPolicy) and policy.capacity == 2
    assert policy.request("a") is False and policy.request("a") is True
    assert "a" in policy and len(policy) == 1 and "b" not in policy
    policy.request("b")
    for key in policy.resident_keys():  # a snapshot: removal while iterating is fine
        policy.remove(key)
    assert len(policy) == 0 and not evicted  # remove never reports an eviction


@pytest.mark.parametrize("make", POLICIES)
def test_pins_nest_and_block_removal(make: Callable[..., EvictionPolicy]) -> None:
    evicted: list = []
    policy = make(1, on_evict=evicted.append)
    policy.request("a")
    policy.pin("a")
    policy.pin("a")
    policy.unpin("a")
    assert policy.is_pinned("a")
    with pytest.raises(KeyPinnedError):
        policy.remove("a")
    with pytest.raises(AllPinnedError):
        policy.request("b")
    assert "a" in policy and "b" not in policy and not evicted
    assert policy.request("a") is True  # hits on pinned keys are fine
    policy.unpin("a")
    assert not policy.is_pinned("a")
    with pytest.raises(NotPinnedError):
        policy.unpin("a")
    with pytest.raises(NotResidentError):
        policy.pin("zz")
    policy.request("b")
    assert evicted == ["a"] and "b" in policy


def test_lru_peek_does_not_refresh() -> None:
    evicted: list = []
    lru = LRU(2, on_evict=evicted.append)
    lru.request("a")
    lru.request("b")
    assert lru.peek("a")
    lru.request("c")
    assert evicted == ["a"]


def test_lru_pin_skips_to_next_lru() -> None:
    evicted: list = []
    lru = LRU(3, on_evict=evicted.append)
    for key in "abc":
        lru.request(key)
    lru.pin("a")
    lru.request("d")
    assert evicted == ["b"] and list(lru.resident_keys()) == ["a", "c", "d"]
