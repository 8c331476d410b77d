"""A small OpenAI-compatible streaming server for testing benchmark clients on a CPU.

It speaks the parts of vLLM's HTTP API the multi-model benchmark uses:
``POST /v1/completions`` streamed as server-sent events (token ids on every
chunk, a usage chunk, ``[DONE]``), ``GET /health``, ``GET /v1/models`` and
``GET /metrics``. Its "model" is a deterministic function of the prompt, as
greedy decoding on fixed weights is, with a configurable delay before the
first token and between tokens, and failures decided by the prompt (so a test
knows from the schedule which requests must fail). ``/metrics`` counts the
completed full-length requests as ``vllm:num_preemptions_total``, so counter
deltas can be checked exactly.

Each server runs on its own port in one background event-loop thread.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Behaviour:
    """How one fake model answers."""

    first_delay_s: float = 0.02
    token_delay_s: float = 0.01
    #: prompt[-1] % fail_mod == 0: HTTP 500; == 1: the stream breaks off after two tokens (0: never)
    fail_mod: int = 0
    counted_max_tokens: int = 0  # requests of this length count in vllm:num_preemptions_total
    completed: int = field(default=0)


def tokens_for(prompt: list[int], count: int) -> list[int]:
    """The fake model's greedy output: a function of the prompt alone."""
    base = sum(prompt) * 31 + len(prompt)
    return [(base + 7919 * i) % 100_003 for i in range(count)]


def cached_tokens(prompt: list[int]) -> int:
    """What the fake reports as served from its prefix cache: whole 16-token blocks of the first half."""
    return len(prompt) // 2 // 16 * 16


def failure_of(prompt: list[int], fail_mod: int) -> str | None:
    """'http' or 'drop' where ``fail_mod`` says this prompt fails, else None."""
    if not fail_mod:
        return None
    return {0: "http", 1: "drop"}.get(prompt[-1] % fail_mod)


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class FakeModel:
    def __init__(self, name: str, behaviour: Behaviour):
        self.name, self.behaviour = name, behaviour

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt, count, b = body["prompt"], body["max_tokens"], self.behaviour
        if body.get("model") != self.name:
            return web.json_response({"error": {"message": f"no model {body.get('model')}"}}, status=404)
        failure = failure_of(prompt, b.fail_mod)
        if failure == "http":
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        await asyncio.sleep(b.first_delay_s)
        for i, token in enumerate(tokens_for(prompt, count)):
            if i:
                await asyncio.sleep(b.token_delay_s)
            if failure == "drop" and i == 2:
                request.transport.close()  # the connection breaks mid-stream
                return reply
            choice = {"index": 0, "text": "", "token_ids": [token],
                      "finish_reason": "length" if i == count - 1 else None}
            if i == 0:
                choice["prompt_token_ids"] = prompt  # vLLM echoes the prompt once: a long line
            await reply.write(_event({"choices": [choice]}))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": count,
                 "prompt_tokens_details": {"cached_tokens": cached_tokens(prompt)}}
        await reply.write(_event({"choices": [], "usage": usage}))
        await reply.write(b"data: [DONE]\n\n")
        if count == b.counted_max_tokens:
            b.completed += 1
        return reply

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = (f"# TYPE vllm:num_preemptions counter\n"
                f'vllm:num_preemptions_total{{engine="0",model_name="{self.name}"}} {self.behaviour.completed}.0\n'
                f'vllm:num_requests_running{{engine="0",model_name="{self.name}"}} 0.0\n'
                f'vllm:time_to_first_token_seconds_bucket{{le="0.1",model_name="{self.name}"}} 3.0\n')
        return web.Response(text=text)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", self.completions), web.get("/health", self.health),
                        web.get("/v1/models", self.models), web.get("/metrics", self.metrics)])
        return app


class FakeServers:
    """Several fake models, each on its own port of 127.0.0.1, served from one background thread."""

    def __init__(self, models: dict[str, Behaviour]):
        self.models = {name: FakeModel(name, b) for name, b in models.items()}
        self.ports: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _start(self) -> None:
        for name, model in self.models.items():
            runner = web.AppRunner(model.app(), access_log=None)
            await runner.setup()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(runner, sock).start()
            self.ports[name] = sock.getsockname()[1]
            self._runners.append(runner)

    def __enter__(self) -> "FakeServers":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        async def cleanup() -> None:
            for runner in self._runners:
                await runner.cleanup()
        asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
