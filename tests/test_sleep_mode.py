"""vLLM's sleep, wake and ``release_kv_cache_memory`` with kvelastic: the KV pages go and come back.

A user calls ``LLM.sleep(level)`` / ``POST /sleep``, ``wake_up`` and (0.31+)
``release_kv_cache_memory``. Each reaches the engine core, whose wraps
(``patches/sleep_mode.py``) hand the scheduler's pool to its hibernation once vLLM's
own method has run. Here vLLM's own pieces carry the calls: the engine core's utility
handling over a band-C cache served by kvelastic's scheduler pool, vLLM's wire format,
the async client's utility future, ``AsyncLLM`` and the dev HTTP routes with vLLM's
exception handlers. Only the transport (ZMQ sockets) and the GPU workers (the executor,
which keeps vLLM's sleeping tags) are stood in for.

What must hold: asleep (level 1 or 2, or after the release) the pool holds only the null
block's group, vLLM reset its prefix cache and asked its workers to sleep or discard; level
0 gives nothing back; awake, the engine serves the next wave as a vanilla scheduler whose
prefix cache was reset does. Under worker ranks both calls are refused before vLLM's method
changes anything.
"""

from __future__ import annotations

import queue
from argparse import Namespace
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.29+ installed (band C)")

from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.engine.core_client import AsyncMPClient, _process_utility_output  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from kvelastic.patches import sleep_mode  # noqa: E402
from kvelastic.patching.versions import installed_vllm_version  # noqa: E402
from tests.scheduler_harness import cached_blocks_are_all_mapped, drive, make_requests, make_scheduler  # noqa: E402
from tests.test_band_c_patches import patcher_for  # noqa: E402
from tests.test_single_backing_scheduler import band_c_scheduler  # noqa: E402, F401 (a fixture)

IDLE_FOREVER = 3600.0  # no cached block expires during a test: any page given back is the call's
REFUSED = "is not supported with kvelastic under worker ranks"
HAS_RELEASE = sleep_mode.RELEASE.exists_in(installed_vllm_version())


class Executor:
    """The GPU workers behind the engine core: records what the engine asks and keeps vLLM's sleeping tags."""

    # vLLM 0.34 asks whether its own extensible KV cache is on before a pause that clears the cache:
    # kvelastic turns it off (patches/extensible_kv_cache.py)
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(enable_extensible_kv_cache=False))

    def __init__(self) -> None:
        self.calls: list = []
        self.sleeping_tags: set[str] = set()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list:
        self.calls.append(method)
        return []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.sleeping_tags |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))
        self.sleeping_tags -= set(self.sleeping_tags if tags is None else tags)

    def discard(self, tags: tuple[str, ...]) -> None:
        self.calls.append(("discard", tags))
        self.sleeping_tags |= set(tags)

    def reset_mm_cache(self) -> None:
        self.calls.append("reset_mm_cache")

    def reset_encoder_cache(self) -> None:
        self.calls.append("reset_encoder_cache")

    def get_kv_connector_handshake_metadata(self) -> list:
        """Asked on wake where the scheduler has a connector (the host tier's loads): a worker without a KV
        connector of vLLM's answers None."""
        self.calls.append("get_kv_connector_handshake_metadata")
        return [None]


def engine_core(scheduler, executor: Executor):
    """vLLM's ``EngineCoreProc`` around ``scheduler``, without its ``__init__`` (that starts workers on a device)."""
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    proc = object.__new__(EngineCoreProc)
    proc.scheduler = scheduler
    proc.model_executor = executor
    proc.batch_queue = None
    proc.engines_running = False
    proc.reject_new_requests = False
    proc.mm_receiver_cache = None  # a text-only model has none
    proc.output_queue = queue.Queue()
    proc.shutdown_state = EngineShutdownState.RUNNING
    return proc


def serve_utility(proc, frames: tuple) -> list:
    """What the engine core does with one utility request off the wire; its answer's frames."""
    from vllm.v1.engine import EngineCoreRequestType

    proc._handle_client_request(EngineCoreRequestType.UTILITY, MsgpackDecoder().decode(list(frames)))
    _, outputs = proc.output_queue.get_nowait()
    return MsgpackEncoder().encode(outputs)


def utility(proc, method: str, *args: Any):
    """One utility call as a client sends it; the decoded ``UtilityOutput``."""
    frames = MsgpackEncoder().encode((0, 1, method, args))
    return MsgpackDecoder(EngineCoreOutputs).decode(serve_utility(proc, frames)).utility_output


def prefix_cache_of(scheduler) -> int:
    return len(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)


def wave(tag: str) -> list:
    """Four prompts of 20 blocks each, none shared: 80 blocks at once, more than one page group holds."""
    return make_requests(tag, 4, 320, 0, seed=1)


def as_vanilla_after_a_reset() -> list:
    """Waves a and b on a vanilla scheduler whose prefix cache was reset between them."""
    vanilla = make_scheduler()
    first = drive(vanilla, [wave("a")])
    assert vanilla.reset_prefix_cache()
    return first + drive(vanilla, [wave("b")])


@pytest.fixture
def wrapped():
    patcher = patcher_for(sleep_mode.PATCH)
    sleep_mode.PATCH.apply(patcher, None)
    yield
    patcher.revert()


@pytest.mark.parametrize("level", [1, 2])
def test_asleep_only_the_null_blocks_group_is_held_and_awake_it_serves_as_after_a_reset(band_c_scheduler,
                                                                                          wrapped, level):
    scheduler, pool, _, cache = band_c_scheduler(KVCacheLayout.LBNHC, cache_ttl_s=IDLE_FOREVER)
    executor = Executor()
    proc = engine_core(scheduler, executor)
    first = drive(scheduler, [wave("a")])
    assert pool.stats().held_bytes > cache.group_bytes and prefix_cache_of(scheduler) > 0

    assert utility(proc, "sleep", level).failure_message is None
    assert ("sleep", level) in executor.calls and prefix_cache_of(scheduler) == 0
    assert pool.stats().held_bytes == cache.group_bytes and pool.mapped_groups() == frozenset({0})
    assert utility(proc, "is_sleeping").result.result is True

    assert utility(proc, "wake_up", None).failure_message is None
    assert utility(proc, "is_sleeping").result.result is False
    again = drive(scheduler, [wave("b")])
    assert first + again == as_vanilla_after_a_reset() and cached_blocks_are_all_mapped(scheduler, pool)


@pytest.mark.parametrize("level", [1, 2])
def test_with_a_host_tier_sleep_drops_its_copies_so_no_kv_of_the_old_weights_comes_back(band_c_scheduler,
                                                                                       wrapped, level):
    """An RL loop changes the weights while the engine sleeps: the host tier's copies, computed with the old
    ones, must not serve a prompt after wake. Every level drops them, as vLLM drops its prefix cache."""
    scheduler, pool, _, cache = band_c_scheduler(KVCacheLayout.LBNHC, cache_ttl_s=IDLE_FOREVER,
                                                 cpu_bytes=16 * 1024 * 1024)
    tier = scheduler.kvelastic_offload.tier
    proc = engine_core(scheduler, Executor())
    first = drive(scheduler, [wave("a")])
    assert tier.stats().slots_used > 0  # the wave's blocks were stored on the host as they were computed

    assert utility(proc, "sleep", level).failure_message is None
    assert tier.stats().slots_used == 0 and pool.stats().held_bytes == cache.group_bytes
    assert utility(proc, "wake_up", None).failure_message is None
    hits = tier.stats().hits
    again = drive(scheduler, [wave("a")])  # the same prompts: on vanilla, computed afresh after the reset
    vanilla = make_scheduler()
    assert first + again == drive(vanilla, [wave("a")]) + (vanilla.reset_prefix_cache() and
                                                          drive(vanilla, [wave("a")]))
    assert tier.stats().hits == hits  # none of them came from the host


def test_level_0_pauses_and_gives_nothing_back(band_c_scheduler, wrapped):
    scheduler, pool, _, _ = band_c_scheduler(KVCacheLayout.LBNHC, cache_ttl_s=IDLE_FOREVER)
    proc = engine_core(scheduler, Executor())
    drive(scheduler, [wave("a")])
    cached, held = prefix_cache_of(scheduler), pool.stats().held_bytes
    assert utility(proc, "sleep", 0, "keep").failure_message is None
    # Held, not mapped: the mapper may be retiring a group the wave left empty, whose pages move from
    # mapped to the warm reserve, both held.
    assert prefix_cache_of(scheduler) == cached and pool.stats().held_bytes >= held


@pytest.mark.skipif(not HAS_RELEASE, reason="release_kv_cache_memory arrived in vLLM 0.31")
def test_release_gives_the_pages_back_and_the_engine_serves_after_waking_the_kv_cache(band_c_scheduler, wrapped):
    scheduler, pool, _, cache = band_c_scheduler(KVCacheLayout.LBNHC, cache_ttl_s=IDLE_FOREVER)
    executor = Executor()
    proc = engine_core(scheduler, executor)
    first = drive(scheduler, [wave("a")])
    assert utility(proc, "sleep", 0, "keep").failure_message is None  # the pause the call requires

    assert utility(proc, "release_kv_cache_memory").failure_message is None
    assert ("discard", ("kv_cache",)) in executor.calls and prefix_cache_of(scheduler) == 0
    assert pool.stats().held_bytes == cache.group_bytes
    assert utility(proc, "wake_up", ["kv_cache"]).failure_message is None
    assert utility(proc, "wake_up", ["scheduling"]).failure_message is None
    again = drive(scheduler, [wave("b")])
    assert first + again == as_vanilla_after_a_reset()


def test_under_worker_ranks_sleep_and_release_are_refused_before_vllm_changes_anything(band_c_scheduler,
                                                                                       wrapped):
    scheduler, pool, _, _ = band_c_scheduler(KVCacheLayout.LBNHC, cache_ttl_s=IDLE_FOREVER)
    setattr(scheduler, sleep_mode.HIBERNATION_ATTRIBUTE, None)  # what the attachment leaves under worker ranks
    executor = Executor()
    proc = engine_core(scheduler, executor)
    drive(scheduler, [wave("a")])
    cached, held = prefix_cache_of(scheduler), pool.stats().held_bytes

    refused = utility(proc, "sleep", 1)
    assert refused.failure_message.startswith("Call to sleep method failed: kvelastic: sleep " + REFUSED)
    assert executor.calls == [] and prefix_cache_of(scheduler) == cached
    assert utility(proc, "is_scheduler_paused").result.result is False
    assert utility(proc, "sleep", 0, "keep").failure_message is None  # a pause frees nothing: allowed
    if HAS_RELEASE:
        refused = utility(proc, "release_kv_cache_memory")
        assert "kvelastic: release_kv_cache_memory " + REFUSED in refused.failure_message
        assert ("discard", ("kv_cache",)) not in executor.calls and prefix_cache_of(scheduler) == cached
    assert pool.stats().held_bytes >= held


class LoopbackClient(AsyncMPClient):
    """vLLM's async engine core client with its ZMQ sockets replaced by a direct hand-over to one engine core.

    vLLM's own ``_call_utility_async`` encodes the request and awaits its
    future; here the frames go to the engine core and the answer's frames to
    vLLM's ``_process_utility_output``, as the client's output task would.
    """

    def __init__(self, proc) -> None:  # not AsyncMPClient's: that starts or connects to engine processes
        self.proc = proc
        self.encoder = MsgpackEncoder()
        self.utility_results = {}
        self.client_index = 0
        self.core_engine = b"\x00\x00"
        self.core_engines = [self.core_engine]

    async def _send_input_message(self, message: tuple, engine: bytes) -> None:
        answer = MsgpackDecoder(EngineCoreOutputs).decode(serve_utility(self.proc, message[1:]))
        _process_utility_output(answer.utility_output, self.utility_results)

    def _ensure_output_queue_task(self) -> None:
        pass

    def shutdown(self, timeout: float | None = None) -> None:
        pass  # no engine process or socket of its own


class Renderer:
    """The front end's renderer: only its multimodal cache is cleared on this call."""

    def clear_mm_cache(self) -> None:
        pass

    async def clear_mm_cache_async(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def async_llm(proc):
    """vLLM's ``AsyncLLM`` (without its ``__init__``) over the loopback client."""
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = object.__new__(AsyncLLM)
    llm.engine_core, llm.renderer, llm.logger_manager = LoopbackClient(proc), Renderer(), None
    return llm


def test_the_http_routes_sleep_and_wake_the_engine_and_it_serves_on(band_c_scheduler, wrapped):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.dev.sleep.api_router import attach_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    scheduler, pool, _, cache = band_c_scheduler(KVCacheLayout.BLNHC, cache_ttl_s=IDLE_FOREVER)
    proc = engine_core(scheduler, Executor())
    drive(scheduler, [wave("a")])
    app = FastAPI()
    init_exception_handler(app)
    attach_router(app)
    app.state.engine_client = async_llm(proc)
    app.state.args = Namespace(log_error_stack=False)
    http = TestClient(app, raise_server_exceptions=False)
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert pool.stats().held_bytes == cache.group_bytes
    assert http.post("/wake_up").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert not scheduler.has_requests() and drive(scheduler, [wave("b")])
