"""vLLM 0.31+'s ``release_kv_cache_memory`` with kvelastic on: refused along vLLM's own call path.

A user calls it as ``LLM.release_kv_cache_memory()`` or ``POST /release_kv_cache_memory``
after pausing with ``sleep(level=0)``. Both reach ``EngineCore.release_kv_cache_memory``,
which kvelastic refuses (``patches/release_kv_cache_refusal.py``: the call would discard a
CuMem pool that holds none of kvelastic's pages). Here vLLM's own pieces carry the call:
the engine core's utility handling over a band-C cache served by kvelastic's scheduler
pool, vLLM's wire format for the answer, the async client's utility future, ``AsyncLLM``,
the dev HTTP route with vLLM's exception handlers, and the in-process ``LLMEngine`` path.
Only the transport (ZMQ sockets) and the GPU workers (the executor) are stood in for.

What must hold: the caller gets kvelastic's message; nothing was reset, discarded or
given back (the executor never sees ``discard``, the pool holds as many pages and the prefix
cache as many blocks as before); the engine goes on serving and its next wave hits the prefix cache exactly as
a vanilla scheduler's does. vLLM's own method, run the same way, resets the cache: that is
what the refusal is told apart from.
"""

from __future__ import annotations

import queue
from argparse import Namespace
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.29+ installed (band C)")

from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.engine.core_client import AsyncMPClient, _process_utility_output  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from kvelastic.errors import UnsupportedOperation  # noqa: E402
from kvelastic.patches import release_kv_cache_refusal  # noqa: E402
from kvelastic.patching.versions import installed_vllm_version  # noqa: E402
from tests.scheduler_harness import cached_blocks_are_all_mapped, drive, make_requests, make_scheduler  # noqa: E402
from tests.test_band_c_patches import patcher_for  # noqa: E402
from tests.test_single_backing_scheduler import band_c_scheduler  # noqa: E402, F401 (a fixture)

IDLE_FOREVER = 3600.0  # no cached block expires during a test: any page given back would be the call's
REFUSED = "kvelastic: release_kv_cache_memory is not supported"

pytestmark = pytest.mark.skipif(not release_kv_cache_refusal.PATCH.claims(installed_vllm_version()),
                                reason="release_kv_cache_memory arrived in vLLM 0.31; the installed vLLM has none")


class Executor:
    """The GPU workers behind the engine core: records what the engine asks of them."""

    is_sleeping = False

    def __init__(self) -> None:
        self.calls: list = []

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list:
        self.calls.append(method)
        return []

    def discard(self, tags: tuple[str, ...]) -> None:
        self.calls.append(("discard", tags))

    def reset_mm_cache(self) -> None:
        self.calls.append("reset_mm_cache")

    def reset_encoder_cache(self) -> None:
        self.calls.append("reset_encoder_cache")


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
    return make_requests(tag, 4, 320, 320, seed=0)  # the same prompts in every wave: all but the last token hit


@pytest.fixture
def refusal():
    patcher = patcher_for(release_kv_cache_refusal.PATCH)
    release_kv_cache_refusal.PATCH.apply(patcher, None)
    yield
    patcher.revert()


def test_refused_through_the_engine_core_with_nothing_reset_discarded_or_unmapped(band_c_scheduler, refusal):
    scheduler, pool, _, _ = band_c_scheduler(KVCacheLayout.LBNHC, cache_ttl_s=IDLE_FOREVER)
    executor = Executor()
    proc = engine_core(scheduler, executor)
    first = drive(scheduler, [wave("a")])
    assert utility(proc, "sleep", 0, "keep").failure_message is None  # the pause the call requires
    cached, held = prefix_cache_of(scheduler), pool.stats().held_bytes
    assert cached > 0 and held > 0

    answer = utility(proc, "release_kv_cache_memory")
    assert answer.failure_message.startswith("Call to release_kv_cache_memory method failed: " + REFUSED)
    assert ("discard", ("kv_cache",)) not in executor.calls
    assert prefix_cache_of(scheduler) == cached and cached_blocks_are_all_mapped(scheduler, pool)
    # The call gave nothing back. Held, not mapped: the mapper may map ahead, or still be retiring
    # a group the wave left empty, whose pages move from mapped to the warm reserve, both held
    # (CI saw mapped fall by one such group while held stayed equal).
    assert pool.stats().held_bytes >= held
    assert utility(proc, "is_scheduler_paused").result.result is True  # the pause is the user's to end

    assert utility(proc, "wake_up", ["scheduling"]).result.result is True
    again = drive(scheduler, [wave("b")])
    vanilla = make_scheduler()
    assert first + again == drive(vanilla, [wave("a"), wave("b")])  # b hit the prefix cache as without the call


def test_vllms_own_release_resets_the_prefix_cache_the_same_path_shows_it(band_c_scheduler):
    scheduler, _, _, _ = band_c_scheduler(KVCacheLayout.LBNHC, cache_ttl_s=IDLE_FOREVER)
    executor = Executor()
    proc = engine_core(scheduler, executor)
    drive(scheduler, [wave("a")])
    utility(proc, "sleep", 0, "keep")
    assert prefix_cache_of(scheduler) > 0

    assert utility(proc, "release_kv_cache_memory").failure_message is None
    assert ("discard", ("kv_cache",)) in executor.calls and prefix_cache_of(scheduler) == 0


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


def test_the_http_endpoint_answers_with_kvelastics_message_and_the_engine_serves_on(band_c_scheduler, refusal):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.dev.sleep.api_router import attach_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    scheduler, pool, _, _ = band_c_scheduler(KVCacheLayout.BLNHC, cache_ttl_s=IDLE_FOREVER)
    executor = Executor()
    proc = engine_core(scheduler, executor)
    drive(scheduler, [wave("a")])
    app = FastAPI()
    init_exception_handler(app)
    attach_router(app)
    app.state.engine_client = async_llm(proc)
    app.state.args = Namespace(log_error_stack=False)
    http = TestClient(app, raise_server_exceptions=False)
    assert http.post("/sleep", params={"level": 0, "mode": "keep"}).status_code == 200
    held = pool.stats().held_bytes

    refused = http.post("/release_kv_cache_memory")
    assert refused.status_code == 500
    assert REFUSED in refused.json()["error"]["message"]
    assert ("discard", ("kv_cache",)) not in executor.calls
    assert cached_blocks_are_all_mapped(scheduler, pool) and pool.stats().held_bytes >= held  # as above
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/wake_up", params={"tags": "scheduling"}).json()["status"] == "awake"
    assert not scheduler.has_requests() and drive(scheduler, [wave("b")])


def test_llm_in_process_raises_kvelastics_refusal_itself(band_c_scheduler, refusal):
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine

    scheduler, _, _, _ = band_c_scheduler(KVCacheLayout.LBNHC, cache_ttl_s=IDLE_FOREVER)
    client = object.__new__(InprocClient)
    client.engine_core = engine_core(scheduler, Executor())
    client.sleep(0, "keep")
    engine = object.__new__(LLMEngine)
    engine.engine_core, engine.renderer, engine.logger_manager = client, Renderer(), None
    with pytest.raises(UnsupportedOperation, match=REFUSED):
        engine.release_kv_cache_memory()
    assert client.engine_core.is_scheduler_paused()

