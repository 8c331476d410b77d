"""Streamed completions from OpenAI-compatible servers, timed token by token, sent open loop.

Every request is sent at its scheduled moment whether or not earlier ones
have finished (open loop: a slow server meets a growing queue, as in
production, instead of a politely waiting client). Each reply is streamed
(``stream: true``) with the generated token ids on every chunk
(``return_token_ids``, vLLM's extension), so the first token's arrival gives
TTFT, the later ones TPOT, and the ids themselves can be compared token for
token with another run. Greedy decoding (temperature 0) and ``ignore_eos``
make every request generate exactly ``max_tokens`` tokens.

Statuses: ``ok``; ``error`` (HTTP status, broken connection, an error event in
the stream, a stream without its end); ``timeout`` (the per-request limit);
``short`` (fewer tokens than asked: the server stopped early); ``unfinished``
(still running when the benchmark stopped waiting for it).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from benchmarks.mmbench.workload import Request, Workload, prompt_ids

FAILED = ("error", "timeout", "short")
UNFINISHED = "unfinished"


class NotReady(RuntimeError):
    """A server did not answer ``/health`` (or serves another model) in time."""


class StreamError(RuntimeError):
    """The server reported an error inside the stream, or the stream broke off."""


@dataclass(frozen=True)
class Server:
    """One server: the model name it serves and its base URL."""

    model: str
    url: str


class SseBuffer:
    """Splits a byte stream into the payloads of its ``data:`` lines.

    Lines can be long (vLLM echoes the prompt's ids in the first chunk), so no
    line-length limit applies: bytes are kept until their newline arrives.
    """

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        return [line[5:].strip().decode() for line in lines if line.startswith(b"data:")]


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def new_record(request: Request, sent_s: float) -> dict[str, Any]:
    return {"index": request.index, "model": request.model, "probe": request.probe, "send_s": request.send_s,
            "sent_s": round(sent_s, 6), "status": UNFINISHED, "error": None, "ttft_s": None, "tpot_s": None,
            "tokens": [], "chunks": [], "prompt_tokens": None, "cached_tokens": None, "finish_reason": None}


def _take_event(record: dict[str, Any], payload: dict[str, Any], since_send: float) -> None:
    """Fold one streamed chunk into the record: its token ids, their arrival, the final usage."""
    if "error" in payload:
        raise StreamError(f"error event: {json.dumps(payload['error'])[:300]}")
    for choice in payload.get("choices") or []:
        ids = choice.get("token_ids") or []
        if ids:
            record["tokens"].extend(ids)
            record["chunks"].append([round(since_send, 5), len(ids)])
        record["finish_reason"] = choice.get("finish_reason") or record["finish_reason"]
    usage = payload.get("usage")
    if usage:
        record["prompt_tokens"] = usage.get("prompt_tokens")
        record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def finish_timing(record: dict[str, Any], max_tokens: int) -> None:
    """TTFT, TPOT and the status of a stream that ended with ``[DONE]``.

    TPOT is (last token - first token) / (tokens - 1): the decode pace after the first
    token, as vLLM's own ``request_time_per_output_token`` defines it.
    """
    chunks = record["chunks"]
    if chunks:
        record["ttft_s"] = chunks[0][0]
        count = sum(n for _, n in chunks)
        if count > 1:
            record["tpot_s"] = (chunks[-1][0] - chunks[0][0]) / (count - 1)
    got = len(record["tokens"])
    record["status"] = "ok" if got >= max_tokens else "short"
    if got < max_tokens:
        record["error"] = f"{got} of {max_tokens} tokens (finish_reason {record['finish_reason']})"


async def _exchange(session: aiohttp.ClientSession, server: Server, body: dict[str, Any],
                    record: dict[str, Any]) -> bool:
    """POST and read the stream into ``record``; True if it ended with ``[DONE]``."""
    started, buffer = time.perf_counter(), SseBuffer()
    async with session.post(server.url + "/v1/completions", json=body) as reply:
        if reply.status != 200:
            raise StreamError(f"HTTP {reply.status}: {(await reply.text())[:300]}")
        async for data in reply.content.iter_any():
            for payload in buffer.feed(data):
                if payload == "[DONE]":
                    return True
                _take_event(record, json.loads(payload), time.perf_counter() - started)
    return False


async def stream_completion(session: aiohttp.ClientSession, server: Server, prompt: list[int],
                            record: dict[str, Any], max_tokens: int, timeout_s: float) -> None:
    """Send one streamed completion and fill ``record`` in place (also on failure)."""
    body = request_body(server.model, prompt, max_tokens)
    try:
        if not await asyncio.wait_for(_exchange(session, server, body, record), timeout_s):
            raise StreamError("the stream ended without [DONE]")
        finish_timing(record, max_tokens)
    except asyncio.TimeoutError:
        record.update(status="timeout", error=f"no complete reply within {timeout_s:g} s")
    except (StreamError, aiohttp.ClientError, ConnectionError, ValueError) as error:
        record.update(status="error", error=f"{type(error).__name__}: {error}"[:400])


class OpenLoop:
    """Sends a workload's requests to its servers and keeps every record."""

    def __init__(self, session: aiohttp.ClientSession, servers: dict[str, Server], workload: Workload,
                 timeout_s: float, clock: Callable[[], float]):
        self.session, self.servers, self.workload = session, servers, workload
        self.timeout_s, self.clock = timeout_s, clock
        self.records: dict[int, dict[str, Any]] = {}

    async def send(self, request: Request) -> dict[str, Any]:
        record = self.records[request.index] = new_record(request, self.clock())
        await stream_completion(self.session, self.servers[request.model], prompt_ids(self.workload, request),
                                record, request.max_tokens, self.timeout_s)
        return record

    async def run_timed(self, requests: list[Request], drain_s: float, stop: asyncio.Event) -> float:
        """Send each timed request at load start + ``send_s``; wait up to ``drain_s`` after the last.

        Returns the load start on :attr:`clock`. Requests still running after the
        drain (or when ``stop`` is set) are cancelled and stay ``unfinished``.
        """
        start, tasks = self.clock(), []
        for request in (r for r in requests if not r.probe):
            delay = start + request.send_s - self.clock()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass
            if stop.is_set():
                break
            tasks.append(asyncio.create_task(self.send(request)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=0 if stop.is_set() else drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return start

    async def run_probes(self, requests: list[Request], stop: asyncio.Event) -> None:
        """The probes, one at a time per model (models side by side): the same batch shape in every run."""
        async def one_model(model: str) -> None:
            for request in (r for r in requests if r.probe and r.model == model):
                if not stop.is_set():
                    await self.send(request)
        await asyncio.gather(*(one_model(model) for model in self.servers))


async def wait_ready(session: aiohttp.ClientSession, servers: list[Server], timeout_s: float,
                     problem: Callable[[], str | None] = lambda: None) -> float:
    """Wait until every server answers ``/health`` and lists its model; the seconds it took.

    ``problem`` is asked every round: a text (a watched process exited) ends the wait at once.
    """
    began, waiting = time.monotonic(), list(servers)
    while waiting:
        for server in list(waiting):
            try:
                async with session.get(server.url + "/health", timeout=aiohttp.ClientTimeout(total=3)) as reply:
                    healthy = reply.status == 200
                if healthy:
                    await _check_model(session, server)
                    waiting.remove(server)
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
                pass
        if not waiting:
            break
        if (why := problem()) is not None:
            raise NotReady(f"{', '.join(s.url for s in waiting)} not ready: {why}")
        if time.monotonic() - began > timeout_s:
            raise NotReady(f"{', '.join(s.url for s in waiting)} not ready after {timeout_s:g} s")
        await asyncio.sleep(1.0)
    return time.monotonic() - began


async def _check_model(session: aiohttp.ClientSession, server: Server) -> None:
    async with session.get(server.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as reply:
        listed = [m.get("id") for m in (await reply.json()).get("data", [])]
    if server.model not in listed:
        raise NotReady(f"{server.url} serves {listed}, not {server.model!r} (check --served-model-name)")
