"""OpenAI-compatible handlers: /v1/completions, /v1/chat/completions (streamed as SSE or whole), /v1/models.
They shape the output processor's events into OpenAI's chunk and response objects."""

from __future__ import annotations

import contextlib
import dataclasses
import time

from aiohttp import web

from services.gateway.api import sse
from services.gateway.engine.replicas import SESSION_HEADER
from services.gateway.engine.request import Request
from services.gateway.frontend.events import RequestHandle
from services.gateway.frontend.frontend import GATEWAY, json_body, tool_parser
from services.gateway.frontend.output import DoneEvent, ErrorEvent, TokenEvent
from services.gateway.frontend.schemas import GenerationSpec, RequestError
from services.gateway.frontend.tools import CallStarted, ContentDelta, ToolCallParser, ToolEvent


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _completion_top(alternatives: list[dict]) -> dict[str, float]:
    """{text: logprob}, most likely first; of tokens with the same text the most likely one stays."""
    out: dict[str, float] = {}
    for a in alternatives:
        out.setdefault(a["text"], a["logprob"])
    return out


class OpenAIShape:
    """One request's OpenAI objects: the id, the chunk envelope, the final response, and (when the request asked
    for logprobs) each token's logprobs in chat's or completions' shape."""

    def __init__(self, seq: Request, chat: bool, model_id: str, spec: GenerationSpec, created: int | None = None):
        self.chat = chat
        self.logprobs, self.top_logprobs = spec.logprobs, spec.sampling.top_logprobs
        self.text_offset = 0  # completions: characters of text before the next token
        self.base = {"id": ("chatcmpl-" if chat else "cmpl-") + seq.seq_id,
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()) if created is None else created, "model": model_id}

    def logprobs_field(self, events: list[TokenEvent]) -> dict | None:
        """The choice's "logprobs" for these token events (in order, the next after those already shaped)."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [{**_chat_token(e.token_text, e.logprob),
                                 "top_logprobs": [_chat_token(a["text"], a["logprob"])
                                                  for a in e.top_logprobs or ()]}
                                for e in events if e.logprob is not None]}
        offsets = []
        for e in events:
            offsets.append(self.text_offset)
            self.text_offset += len(e.text)
        field = {"tokens": [e.token_text if e.token_text is not None else e.text for e in events],
                 "token_logprobs": [e.logprob for e in events], "text_offset": offsets}
        if self.top_logprobs:
            field["top_logprobs"] = [_completion_top(e.top_logprobs) if e.top_logprobs is not None else None
                                     for e in events]
        return field

    def chunk(self, delta_or_text, finish: str | None = None, logprobs: dict | None = None) -> dict:
        key = "delta" if self.chat else "text"
        return {**self.base, "choices": [{"index": 0, key: delta_or_text, "finish_reason": finish, "logprobs": logprobs}]}

    def token_chunk(self, ev: TokenEvent) -> dict:
        return self.chunk({"content": ev.text} if self.chat else ev.text, logprobs=self.logprobs_field([ev]))

    def final_chunk(self, done: DoneEvent) -> dict:
        return self.chunk({} if self.chat else "", finish=done.finish_reason)

    def usage_chunk(self, done: DoneEvent) -> dict:
        return {**self.base, "choices": [], "usage": done.usage.to_json()}

    def tool_chunks(self, events: list[ToolEvent]) -> list[dict]:
        """ToolCallParser events -> chat chunks: content deltas, then each call's start and argument fragments."""
        chunks = []
        for ev in events:
            if isinstance(ev, ContentDelta):
                chunks.append(self.chunk({"content": ev.text}))
            elif isinstance(ev, CallStarted):
                chunks.append(self.chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                                          "function": {"name": ev.name, "arguments": ""}}]}))
            else:
                chunks.append(self.chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]}))
        return chunks

    def response(self, tokens: list[TokenEvent], done: DoneEvent, tools: ToolCallParser | None = None) -> dict:
        text = "".join(e.text for e in tokens)
        choice = {"index": 0, "finish_reason": done.finish_reason, "logprobs": self.logprobs_field(tokens)}
        if tools is not None:
            events = tools.push(text) + tools.finish()
            content = "".join(ev.text for ev in events if isinstance(ev, ContentDelta))
            choice["message"] = {"role": "assistant", "content": content or None}
            if tools.calls:
                choice["message"]["tool_calls"] = tools.calls
                choice["finish_reason"] = finish_with_calls(done.finish_reason)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {**self.base, "object": "chat.completion" if self.chat else "text_completion", "choices": [choice],
                "usage": done.usage.to_json(), "timings": done.timings}
        if done.trace is not None:
            body["trace"] = done.trace
        return body


def finish_with_calls(reason: str) -> str:
    """An answer that ended by itself (EOS, or the forced call's grammar completing) after calling tools."""
    return "tool_calls" if reason == "stop" else reason


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    handle = await gw.start(await json_body(request), chat, request.headers.get(SESSION_HEADER))
    spec = handle.spec
    shape = OpenAIShape(handle.seq, chat, gw.config.model_id, spec, handle.created)
    try:
        if spec.stream:
            return await _stream_sse(request, gw, handle, shape)
        tokens, done = await gw.collect(handle)
        return web.json_response(shape.response(tokens, done, tool_parser(spec, handle.id)))
    finally:
        gw.leave(handle)  # no-op when finished; frees KV slots when the client went away


async def _stream_sse(request, gw, handle: RequestHandle, shape: OpenAIShape, after: int = -1) -> web.StreamResponse:
    """The request's chunks as SSE, one id `<epoch>:<n>` per chunk (n: 0, 1, ... in the order they are written, the
    role chunk first). After `after` (a resumed stream): the chunks up to it are shaped again, unsent, so every chunk
    after it is the one the first reading sent, id included (the tool parser's and the logprobs' state too). A
    cursor past the last chunk ends the stream with a cursor_out_of_range error, not [DONE]."""
    spec = handle.spec
    out = await sse.SSEStream.open(request)
    n = -1  # the number of the last chunk shaped

    async def send(chunks: list[dict]) -> None:
        nonlocal n
        frames = []
        for chunk in chunks:
            n += 1
            if n > after:
                frames.append(sse.frame(chunk, id=f"{gw.epoch}:{n}"))
        await out.send_frames(frames)

    if shape.chat:
        await send([shape.chunk({"role": "assistant", "content": ""})])
    tools = tool_parser(spec, handle.id)
    async with contextlib.aclosing(gw.events(handle)) as events:
        async for _, ev in events:
            await send(_chunks(shape, spec, tools, ev))
    if after > n:
        await out.send({"error": sse.past_the_end(after, n, "Last-Event-ID").openai_body()["error"]})
    else:
        await out.send("[DONE]")
    return await out.close()


def _chunks(shape: OpenAIShape, spec: GenerationSpec, tools: ToolCallParser | None, ev) -> list[dict]:
    """One client event -> the SSE chunks it makes (none for text held back)."""
    if isinstance(ev, TokenEvent) and tools is not None:
        return shape.tool_chunks(tools.push(ev.text))
    if isinstance(ev, TokenEvent):
        return [shape.token_chunk(ev)] if ev.text or spec.logprobs else []
    if isinstance(ev, ErrorEvent):
        return [{"error": {"message": ev.message, "type": "server_error", "code": ev.code}}]
    chunks = []
    if tools is not None:
        chunks += shape.tool_chunks(tools.finish())
        if tools.calls:
            ev = dataclasses.replace(ev, finish_reason=finish_with_calls(ev.finish_reason))
    chunks.append(shape.final_chunk(ev))
    if spec.include_usage:
        chunks.append(shape.usage_chunk(ev))
    return chunks


async def resume_stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/streams/{id}: a request's SSE stream read again, after the event named by `Last-Event-ID` (or
    `?starting_after=`), as `<epoch>:<n>` or `<n>`; from its start without one. A request marked
    `resumable` keeps generating while no one reads it (RESUME_GRACE_S); an ended one stays readable for a while
    (services/gateway/frontend/events.py). Cursors: services/gateway/api/sse.py."""
    gw = request.app[GATEWAY]
    rid = request.match_info["id"].removeprefix("chatcmpl-").removeprefix("cmpl-")
    handle = await gw.find(rid)
    if handle is None:
        raise RequestError(f"no stream {request.match_info['id']!r} here: it never ran on this gateway, or ended "
                           "too long ago to be kept", status=404, code="stream_not_found")
    after = sse.chat_cursor(request, gw.epoch)
    shape = OpenAIShape(handle.seq, handle.chat, gw.config.model_id, handle.spec, handle.created)
    try:
        return await _stream_sse(request, gw, handle, shape, after)
    finally:
        gw.leave(handle)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    # capabilities (as Ollama names them): "chat" only where a chat template renders messages (the page then
    # completes text instead); max_model_len (vLLM's field): the context every stage holds
    capabilities = ["completion"] + (["chat"] if gw.files.chat_template is not None else [])
    return web.json_response({"object": "list", "data": [{"id": gw.config.model_id, "object": "model", "created": 0,
                                                          "owned_by": "stagemesh", "capabilities": capabilities,
                                                          "max_model_len": gw.replicas.max_seq_len or None}]})
