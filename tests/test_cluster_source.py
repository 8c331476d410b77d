"""SharedBudgetSource: the page source that asks the GPU's shared account before creating pages."""

from __future__ import annotations

import pytest

from kvelastic.cluster import SharedAccount, SharedBudgetExceeded, SharedBudgetSource
from kvelastic.errors import DeviceOutOfMemory, PoolExhausted
from kvelastic.pool import HostBackend
from kvelastic.pool.sources import DeviceSource, LimitedSource, PageSource, ReserveSource


@pytest.fixture
def account(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    acct = SharedAccount.open("GPU-source", 1000)
    yield acct
    acct.close()


class _Counting(PageSource):
    def __init__(self, page_bytes: int, fail: bool = False):
        super().__init__(page_bytes)
        self.live, self.fail = 0, fail

    def acquire(self, count):
        if self.fail:
            raise DeviceOutOfMemory("device full")
        self.live += count
        return [object() for _ in range(count)]

    def release(self, handles):
        self.live -= len(handles)

    @property
    def outstanding_bytes(self):
        return self.live * self.page_bytes


def test_shared_source_asks_before_creating_and_returns_after_destroying(account):
    member = account.join("a", max_bytes=500)
    source = SharedBudgetSource(_Counting(100), member)
    pages = source.acquire(3)
    assert member.info().mapped_bytes == 300 == source.outstanding_bytes
    with pytest.raises(SharedBudgetExceeded, match="max") as info:
        source.acquire(3)
    assert (info.value.requested_bytes, info.value.available_bytes) == (300, 200)
    assert source.upstream.live == 3
    source.release(pages[:2])
    assert member.info().mapped_bytes == 100 and source.upstream.live == 1


def test_shared_source_returns_the_grant_when_the_device_fails(account):
    member = account.join("a")
    source = SharedBudgetSource(_Counting(100, fail=True), member)
    with pytest.raises(DeviceOutOfMemory):
        source.acquire(2)
    assert member.info().mapped_bytes == 0


def test_shared_source_under_the_pool_stack_counts_the_warm_reserve(account):
    page = 64 * 1024
    with SharedAccount.open("host", 4 * page) as acct:
        member = acct.join("a")
        device = DeviceSource(HostBackend(), page)
        reserve = ReserveSource(LimitedSource(SharedBudgetSource(device, member), None))
        assert reserve.grow(10) == 4  # stops quietly at the shared budget
        assert member.info().mapped_bytes == 4 * page
        with pytest.raises(PoolExhausted):
            reserve.acquire(5)
        reserve.trim(1)
        assert member.info().mapped_bytes == page == device.outstanding_bytes


def test_shared_source_counts_before_joining_and_hands_it_over(account):
    source = SharedBudgetSource(_Counting(100))
    warm = source.acquire(4)  # start-up warm-up: never refused, only counted
    source.release(warm[:1])
    member = account.join("late", max_bytes=500)
    source.attach(member)
    assert member.info().mapped_bytes == 300
    with pytest.raises(SharedBudgetExceeded):
        source.acquire(3)
    source.release(warm[1:])
    assert member.info().mapped_bytes == 0
    with pytest.raises(ValueError, match="already attached"):
        source.attach(member)
