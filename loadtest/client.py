"""One streamed request against a server, timed on arrival of each chunk. Speaks stagemesh's websocket protocol
and OpenAI-compatible SSE (completions and chat completions), so the same code measures any such server."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

BACKENDS = ("openai", "openai-chat", "stagemesh-ws")


@dataclass
class RequestResult:
    prompt_len: int
    start: float = 0.0  # perf_counter at send
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds to the first chunk with text
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of every chunk with text
    latency: float = 0.0  # end to end
    output_tokens: int = 0
    text: str = ""

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def _body(backend: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool, eos_id: int | None, temperature: float) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM / stagemesh
        if eos_id is not None:
            body["logit_bias"] = {str(eos_id): -100}  # servers without ignore_eos (llama.cpp's)
    return body


class StreamEndedEarly(Exception):
    """The server closed an SSE stream before its `data: [DONE]` line."""


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON objects of an OpenAI-style SSE stream, in order, up to `data: [DONE]` (StreamEndedEarly without it)."""
    async for raw in response.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise StreamEndedEarly("stream ended without [DONE] (server closed mid-stream)")


async def send_sse(session: aiohttp.ClientSession, base_url: str, backend: str, model: str, prompt: str, prompt_len: int,
                   max_tokens: int, ignore_eos: bool = False, eos_id: int | None = None,
                   temperature: float = 0.0, headers: dict | None = None) -> RequestResult:
    path = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    res = RequestResult(prompt_len)
    res.start = time.perf_counter()
    chunks, usage = 0, None
    try:
        async with session.post(base_url.rstrip("/") + path, headers=headers,
                                json=_body(backend, model, prompt, max_tokens, ignore_eos, eos_id, temperature)) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for msg in sse_events(r):
                if "error" in msg:
                    res.error = f"server error: {msg['error'].get('message', msg['error'])}"
                    return res
                if msg.get("usage"):
                    usage = msg["usage"]
                for c in msg.get("choices") or []:
                    text = c.get("delta", {}).get("content") if backend == "openai-chat" else c.get("text")
                    if text:
                        now = time.perf_counter()
                        if not res.chunk_times:
                            res.ttft = now - res.start
                        res.chunk_times.append(now)
                        res.text += text
                        chunks += 1
    except StreamEndedEarly as e:
        res.error = str(e)
        return res
    except (aiohttp.ClientError, ConnectionError, TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}".strip()
        return res
    res.latency = time.perf_counter() - res.start
    res.output_tokens = usage["completion_tokens"] if usage else chunks
    res.success = True
    return res


async def send_ws(ws: aiohttp.ClientWebSocketResponse, rid: str, prompt: str, prompt_len: int, max_tokens: int,
                  ignore_eos: bool, temperature: float, inbox) -> RequestResult:
    """One generation over a shared stagemesh websocket; `inbox` is this id's queue of server events."""
    res = RequestResult(prompt_len)
    res.start = time.perf_counter()
    await ws.send_json({"type": "generate", "id": rid, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": temperature, "ignore_eos": ignore_eos})
    while True:
        ev = await inbox.get()
        if ev is None:
            res.error = "websocket closed mid-stream"
            return res
        if ev["type"] == "token":
            if ev["text"]:
                now = time.perf_counter()
                if not res.chunk_times:
                    res.ttft = now - res.start
                res.chunk_times.append(now)
                res.text += ev["text"]
        elif ev["type"] == "done":
            res.latency = time.perf_counter() - res.start
            res.output_tokens = ev["usage"]["completion_tokens"]
            res.success = True
            return res
        else:
            res.error = f"{ev.get('code')}: {ev.get('message')}"
            return res
