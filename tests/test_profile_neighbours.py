"""A starting engine's memory profile, as if the other engines kvelastic serves on its GPU had stood still.

Real parts: the GPU's shared account (real files, members that are live processes,
grants through the account's own rules), vLLM's own ``MemorySnapshot`` and its
arithmetic (``__sub__``), and the assertion vLLM's ``determine_available_memory``
makes, in the words it is written in every release: ``init_free >= after_free``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time

import pytest

pytest.importorskip("vllm.utils.mem_utils", reason="needs vllm installed")

from vllm.utils.mem_utils import MemorySnapshot  # noqa: E402

from kvelastic.cluster import SharedAccount  # noqa: E402
from kvelastic.worker.profile_neighbours import READ_DEADLINE_S, NeighbourCorrection, neighbours_bytes  # noqa: E402

GPU = "gpu-test-profile"
GIB = 1 << 30


@pytest.fixture
def shared(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    return tmp_path


def snapshot(free: int, total: int = 80 * GIB, torch_memory: int = 0) -> MemorySnapshot:
    """vLLM's snapshot as measured on a device with ``free`` bytes free (no measurement: no GPU here)."""
    fields = {f.name for f in dataclasses.fields(MemorySnapshot)}
    made = MemorySnapshot(auto_measure=False, **({"device": "cpu"} if "device" in fields else {}))
    made.free_memory, made.total_memory = free, total
    made.cuda_memory = total - free
    made.torch_memory = torch_memory
    made.non_torch_memory = made.cuda_memory - torch_memory
    return made


def test_the_neighbours_bytes_are_what_the_live_members_hold(shared):
    assert neighbours_bytes(GPU, shared) is None  # no account: no neighbour
    with SharedAccount.open(GPU, 100 * GIB) as account:
        a, b = account.join("a"), account.join("b")
        assert a.request(3 * GIB).granted and b.request(2 * GIB).granted
        assert neighbours_bytes(GPU, shared) == 5 * GIB
        b.release(2 * GIB)
        assert neighbours_bytes(GPU, shared) == 3 * GIB
        b.leave()
        a.leave()


def test_a_busy_account_means_no_correction_after_a_short_wait(shared):
    with SharedAccount.open(GPU, 100 * GIB) as account:
        account.join("a").request(GIB)
        with open(account.path, "rb") as held:  # another holder of the account's lock (a member mid-change)
            fcntl.flock(held, fcntl.LOCK_EX)
            started = time.monotonic()
            assert neighbours_bytes(GPU, shared) is None
            assert time.monotonic() - started < READ_DEADLINE_S + 0.5


@pytest.mark.parametrize("neighbour_change", [-6 * GIB, +6 * GIB, 0], ids=["gave-back", "took", "still"])
def test_the_profile_sees_only_this_engines_own_memory(neighbour_change, kv_log):
    """This engine takes 4 GiB (weights, activations) while a neighbour gives back 6 GiB (or takes 6): vLLM's
    check fails on the raw snapshot when the neighbour gave back more, and its count of this engine's memory
    is off by the neighbour's change; on the corrected copy both are this engine's own, and vLLM's snapshot
    itself is left as measured."""
    own = 4 * GIB
    held = iter([20 * GIB, 20 * GIB + neighbour_change])  # the account: at the snapshot, then at the profile
    correction = NeighbourCorrection(lambda: next(held))
    start = snapshot(free=50 * GIB)
    correction.snapshot_taken()
    after = snapshot(free=50 * GIB - own - neighbour_change, torch_memory=own)
    assert (start.free_memory >= after.free_memory) == (neighbour_change >= -own)  # vLLM's assertion, raw
    before = dataclasses.asdict(start)
    corrected = correction.corrected(start)
    assert dataclasses.asdict(start) == before
    if neighbour_change == 0:
        assert corrected is None and not kv_log.text
        return
    assert type(corrected) is MemorySnapshot and corrected.auto_measure is False
    assert corrected.free_memory >= after.free_memory  # vLLM's assertion holds
    assert corrected.free_memory - after.free_memory == own  # its count of this engine's memory
    assert (after - corrected).non_torch_memory == 0  # the non-torch increase: none of it is this engine's
    assert ("gave back" in kv_log.text) == (neighbour_change < 0) and ("took" in kv_log.text) == (neighbour_change > 0)


def test_without_a_reading_at_either_end_nothing_is_corrected():
    for readings in ([None, 5 * GIB], [5 * GIB, None]):
        held = iter(readings)
        correction = NeighbourCorrection(lambda: next(held))
        correction.snapshot_taken()
        assert correction.corrected(snapshot(free=50 * GIB)) is None


def test_vllm_reads_the_corrected_copy_while_it_profiles_and_its_own_snapshot_after(monkeypatch):
    """Through the patch's own wrapper and a Patcher cleared for its targets: the worker's ``init_snapshot`` is
    the corrected copy for the length of the call (what vLLM's ``determine_available_memory`` reads) and
    vLLM's own object again after it, also when the call raises."""
    import torch

    from kvelastic.patches import worker_capacity
    from kvelastic.patching.apply import Patcher
    from kvelastic.patching.versions import installed_vllm_version
    from kvelastic.settings import Settings
    from kvelastic.startup.runtime import Runtime

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (40 * GIB, 80 * GIB))
    patcher = Patcher(installed_vllm_version(), worker_capacity.TARGETS)
    held = iter([20 * GIB, 14 * GIB, 20 * GIB, 14 * GIB])
    correction = NeighbourCorrection(lambda: next(held))
    worker = type("Worker", (), {})()  # what the wrapper touches of vLLM's worker: its start snapshot
    worker.init_snapshot = own = snapshot(free=50 * GIB)
    seen = []

    def profile(fail: bool) -> int:
        seen.append(worker.init_snapshot)
        if fail:
            raise RuntimeError("profiling failed")
        return 8 * GIB

    runtime = Runtime(Settings(enabled=True))
    for fail in (False, True):
        correction.snapshot_taken()
        if fail:
            with pytest.raises(RuntimeError):
                worker_capacity._determine(runtime, patcher, correction, profile, worker, (True,), {})
        else:
            assert worker_capacity._determine(runtime, patcher, correction, profile, worker, (False,), {}) > 0
        assert seen[-1] is not own and seen[-1].free_memory == own.free_memory + 6 * GIB
        assert worker.init_snapshot is own and patcher.changes == ()


def test_the_account_read_belongs_to_this_users_scope(shared):
    """A file another user planted where the account would be is not read (the account's own checks)."""
    with SharedAccount.open(GPU, 100 * GIB) as account:
        path = account.path
    os.chmod(path, 0o666)  # writable by anyone: not an account kvelastic trusts
    assert neighbours_bytes(GPU, shared) is None
