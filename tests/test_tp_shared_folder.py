"""A shared folder another user squats, or a full one, does not stop a tensor-parallel engine from starting.

The engine is real processes: two worker ranks (``tests/tp_ranks.py``)
and vLLM's real scheduler in this process, patched, connected from the ranks'
descriptions. The ranks and their scheduler meet only on vLLM's calls, so neither
opens anything in the shared folder for the protocol; the shared folder holds only
the GPUs' accounts, which the scheduler joins as a one-GPU engine does. Where it
cannot (the folder squatted by another user, or ``/dev/shm`` full) the engine
serves on its own limit, says so once, and every block it hands out is checked on
both ranks.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm installed")

from kvelastic.settings import Settings  # noqa: E402
from tests.kv_fixtures import GROUP_BYTES  # noqa: E402
from tests.other_user import OTHER_UID, as_user, needs_root, shared_root  # noqa: E402,F401 (a fixture)
from tests.scheduler_harness import make_requests  # noqa: E402
from tests.tiny_tmpfs import mounted_tiny_tmpfs  # noqa: E402
from tests.test_tp_real_scheduler import close_engines, drive_ranks, engine_over  # noqa: E402
from tests.tp_ranks import RankProcesses  # noqa: E402

pytestmark = needs_root


def _squat(folder: str) -> str:
    os.makedirs(folder, mode=0o755)
    Path(folder, "mine").write_text("another user's")
    return "squatted"


@pytest.fixture
def squatted(shared_root) -> Path:  # noqa: F811 - shared_root: a /dev/shm-like root as KVELASTIC_SHARED_DIR
    """The folder for this user in that root, made first by another user."""
    folder = shared_root / f"kvelastic-u{os.geteuid()}"
    assert as_user(_squat, str(folder)) == "squatted"
    assert folder.stat().st_uid == OTHER_UID
    return folder


@pytest.fixture
def full(monkeypatch):
    """A ``/dev/shm``-like tmpfs of 64 KiB, filled: no account file fits."""
    with mounted_tiny_tmpfs("kvelastic-full-") as where:
        monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(where))
        monkeypatch.delenv("KVELASTIC_SHARED_GROUP", raising=False)
        (where / "filler").write_bytes(b"x" * 64 * 1024)  # as much as the tmpfs takes
        yield where


def _serve_a_wave(kv_log) -> list[str]:
    """Start a TP=2 engine whose ranks name a GPU (so its scheduler joins that GPU's account), serve a wave with
    every block checked on both ranks; the warnings kvelastic logged."""
    made: list = []
    try:
        ranks = RankProcesses(devices=("gpu-squat", "gpu-squat2"))
        made.append(ranks)
        settings = Settings(enabled=True, name="tp-victim", shared_budget_bytes=64 * GROUP_BYTES)
        made.append(engine_over(ranks, settings))
        scheduler = made[-1][0]
        waves = [make_requests("a", 4, 320, 0, seed=0), make_requests("b", 4, 320, 0, seed=0)]
        trace = drive_ranks(scheduler, ranks, waves)
        scheduler.kvelastic_reclaimer.tick()
        assert {rid for step in trace for rid, _ in step} == {r.request_id for wave in waves for r in wave}
        assert len({info.gpu_id for info in ranks.infos}) == 2  # so the scheduler does try to join two accounts
    finally:
        close_engines(made)
    # one message per record (a record may be captured twice: through kv_log's handler and the root's)
    return list({id(r): r.getMessage() for r in kv_log.records
                 if r.levelno >= logging.WARNING and r.name in ("kvelastic", "vllm.kvelastic")}.values())


def _says_once_it_serves_alone(warnings: list[str]) -> None:
    """Once per GPU's account (two GPUs), however many steps and reclaimer ticks ran."""
    alone = [w for w in warnings if "could not join" in w and "own limit" in w]
    assert len(alone) == 2, warnings


def test_a_folder_another_user_squats_leaves_a_tp_engine_serving_on_its_own_limit(squatted, kv_log):
    before = sorted(os.listdir(squatted))
    warnings = _serve_a_wave(kv_log)
    _says_once_it_serves_alone(warnings)
    assert any("uid 54321" in w or str(OTHER_UID) in w for w in warnings), warnings
    assert sorted(os.listdir(squatted)) == before, "the engine wrote into another user's folder"


def test_a_full_shared_folder_leaves_a_tp_engine_serving_on_its_own_limit(full, kv_log):
    warnings = _serve_a_wave(kv_log)
    _says_once_it_serves_alone(warnings)
    assert any("space" in w.lower() for w in warnings), warnings
