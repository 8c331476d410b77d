"""Property tests: the pool's accounting stays exact under any sequence of operations."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvelastic.errors import PoolExhausted
from kvelastic.pool import HostBackend, PagePool
from tests.test_pool_host import ManualFence

PAGE = 16 * 1024
GROUPS = 12
TENSOR_PAGES = (12, 12, 7)


class PoolMachine(RuleBasedStateMachine):
    """A model of which groups are mapped, checked against the pool and the memory itself."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool.standard(HostBackend(max_bytes=40 * PAGE), page_bytes=PAGE)
        self.tensors = [self.pool.add_tensor(n * PAGE) for n in TENSOR_PAGES]
        self.mapped: set[int] = set()
        self.fences: list[ManualFence] = []
        self.stamp: dict[int, int] = {}
        self.counter = 0

    def _pages(self, groups: set[int]) -> int:
        return sum(1 for g in groups for n in TENSOR_PAGES if g < n)

    @rule(groups=st.sets(st.integers(0, GROUPS - 1), max_size=5))
    def map(self, groups: set[int]) -> None:
        try:
            self.pool.map_groups(groups)
        except PoolExhausted:
            assert self.pool.mapped_groups() == self.mapped
            return
        for g in groups - self.mapped:
            self.counter += 1
            self.stamp[g] = self.counter % 100 + 1
            for t, n in zip(self.tensors, TENSOR_PAGES):
                if g < n:
                    t[g * PAGE] = self.stamp[g]
        self.mapped |= groups

    @rule(groups=st.sets(st.integers(0, GROUPS - 1), max_size=5), fenced=st.booleans())
    def unmap(self, groups: set[int], fenced: bool) -> None:
        fence = None
        if fenced:
            fence = ManualFence()
            self.fences.append(fence)
        self.pool.unmap_groups(groups, fence=fence)
        self.mapped -= groups
        for g in groups:
            self.stamp.pop(g, None)

    @precondition(lambda self: self.fences)
    @rule(index=st.integers(0, 50))
    def pass_fence(self, index: int) -> None:
        self.fences.pop(index % len(self.fences)).done = True
        self.pool.collect()

    @rule(limit_pages=st.one_of(st.none(), st.integers(0, 40)))
    def set_limit(self, limit_pages: int | None) -> None:
        self.pool.set_limit(None if limit_pages is None else limit_pages * PAGE)

    @rule(pages=st.integers(0, 6))
    def grow(self, pages: int) -> None:
        self.pool.grow_reserve(pages)

    @rule()
    def park(self) -> None:
        self.pool.grow_reserve(0)  # parks warm pages at the lowest unmapped groups

    @rule(keep=st.integers(0, 4))
    def trim(self, keep: int) -> None:
        self.pool.trim_reserve(keep)

    @invariant()
    def accounting_is_exact(self) -> None:
        s = self.pool.stats()
        assert self.pool.mapped_groups() == self.mapped
        assert s.mapped_bytes == self._pages(self.mapped) * PAGE
        assert s.held_bytes == s.mapped_bytes + s.pending_unmap_bytes + s.reserve_bytes
        assert s.held_bytes == self.pool.backend._created_bytes
        assert not self.pool.parked_groups() & self.mapped
        if s.limit_bytes is not None and s.held_bytes > s.limit_bytes:
            assert s.reserve_bytes == 0  # only mapped data may sit above a lowered limit

    @invariant()
    def mapped_data_is_intact(self) -> None:
        for g in self.mapped:
            for t, n in zip(self.tensors, TENSOR_PAGES):
                if g < n:
                    assert int(t[g * PAGE]) == self.stamp[g]
                    assert torch.count_nonzero(t[g * PAGE + 1:(g + 1) * PAGE]) == 0

    def teardown(self) -> None:
        self.pool.close()
        assert self.pool.leak_report() == []


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPoolMachine = PoolMachine.TestCase
