"""The gateway's aiohttp application: OpenAI-compatible API, websocket stream, probes, metrics, chat page."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass

from aiohttp import WSCloseCode, WSMsgType, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import Pipeline
from services.gateway.scheduler import QueueFull, Scheduler, Sequence
from services.gateway.schemas import GenerationSpec, RequestError, parse_generation
from shared.errors import ChatTemplateError
from shared.model_files import ModelFiles
from shared.streaming import TextStream

log = logging.getLogger("stagemesh.gateway")

STATIC = os.path.join(os.path.dirname(__file__), "static")
MAX_BODY_BYTES = 1 << 20
MAX_WS_MESSAGE = 1 << 20
DEFAULT_TIMEOUT_S = 600.0
MAX_STREAMS_PER_SOCKET = 64


API_KEY_ENV = "STAGEMESH_API_KEY"  # when set, /v1/* requires `Authorization: Bearer <key>`


@dataclass
class GatewayConfig:
    model_id: str
    api_key: str | None = None
    default_max_tokens: int = 256
    request_timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class Gateway:
    """What the handlers need, in one typed object stored on the app."""

    files: ModelFiles
    pipeline: Pipeline
    scheduler: Scheduler
    metrics: GatewayMetrics
    config: GatewayConfig

    async def prepare(self, spec: GenerationSpec) -> Sequence:
        """Tokenize (in a thread: chat templates may take up to their time cap) and check the context."""
        if not self.pipeline.ready:
            raise RequestError(f"the pipeline is not ready: {self.pipeline.problem}", status=503, code="not_ready")
        loop = asyncio.get_running_loop()
        try:
            if spec.messages is not None:
                ids = await loop.run_in_executor(None, self.files.chat_prompt_ids, spec.messages)
            else:
                ids = await loop.run_in_executor(None, self.files.tokenizer.encode, spec.prompt)
        except ChatTemplateError as e:
            raise RequestError(str(e), "messages") from None
        context = self.pipeline.max_seq_len
        if not ids:
            raise RequestError("the prompt is empty after tokenization", "prompt")
        if len(ids) >= context:
            raise RequestError(f"the prompt has {len(ids)} tokens; this deployment's context is {context} tokens",
                               "messages" if spec.messages is not None else "prompt", code="context_length_exceeded")
        max_tokens = spec.max_tokens or min(self.config.default_max_tokens, context - len(ids))
        if len(ids) + max_tokens > context:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                               f"{context} tokens; lower max_tokens", "max_tokens", code="context_length_exceeded")
        timeout = spec.timeout_s or self.config.request_timeout_s
        return Sequence(ids, spec.sampling.with_seed(), max_tokens,
                        TextStream(self.files.tokenizer, spec.stop),
                        frozenset() if spec.ignore_eos else self.files.tokenizer.eos_ids,
                        deadline=time.perf_counter() + timeout, trace=spec.trace)

    def submit(self, seq: Sequence) -> None:
        try:
            self.scheduler.submit(seq)
        except QueueFull as e:
            raise RequestError(str(e), status=429, code="queue_full") from None


GATEWAY = web.AppKey("gateway", Gateway)


def _error(e: RequestError, headers: dict | None = None) -> web.Response:
    return web.json_response(e.openai_body(), status=e.status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every error leaves in OpenAI's shape with a message that says what to fix."""
    try:
        key = request.app[GATEWAY].config.api_key
        if key and request.path.startswith("/v1/") and not hmac.compare_digest(
                request.headers.get("Authorization", "") or f"Bearer {request.query.get('api_key', '')}",
                f"Bearer {key}"):
            raise RequestError(f"missing or wrong API key: send 'Authorization: Bearer <key>' ({API_KEY_ENV})",
                               status=401, code="invalid_api_key")
        return await handler(request)
    except RequestError as e:
        request.app[GATEWAY].metrics.rejected.labels(str(e.status)).inc()
        return _error(e, {"Retry-After": "1"} if e.status in (429, 503) else None)
    except web.HTTPRequestEntityTooLarge:
        return _error(RequestError(f"request body exceeds {MAX_BODY_BYTES} bytes", status=413, code="body_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(RequestError(f"{e.reason}: {request.method} {request.path}", status=e.status, code="http_error"))


async def _json_body(request: web.Request) -> dict:
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


# ---- OpenAI-compatible API ---------------------------------------------------------------------------------------

def _logprobs_field(chat: bool, events: list[dict]) -> dict | None:
    if chat:
        return {"content": [{"token": e["text"], "logprob": e["logprob"], "bytes": None, "top_logprobs": []}
                            for e in events if e.get("logprob") is not None]}
    return {"tokens": [e["text"] for e in events], "token_logprobs": [e["logprob"] for e in events]}


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    spec = parse_generation(await _json_body(request), chat, gw.pipeline.max_seq_len or 1 << 20)
    seq = await gw.prepare(spec)
    gw.submit(seq)
    rid = ("chatcmpl-" if chat else "cmpl-") + seq.seq_id
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": gw.config.model_id}
    try:
        if spec.stream:
            return await _stream_sse(request, seq, spec, chat, base)
        texts, lp_events = [], []
        while True:
            ev = await seq.events.get()
            if ev["type"] == "token":
                texts.append(ev["text"])
                lp_events.append(ev)
            elif ev["type"] == "error":
                raise RequestError(ev["message"], status=503 if ev["code"] == "error" else 504, code=ev["code"])
            else:
                break
        text = "".join(texts)
        choice = {"index": 0, "finish_reason": ev["finish_reason"],
                  "logprobs": _logprobs_field(chat, lp_events) if spec.logprobs else None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": ev["usage"], "timings": ev["timings"]}
        if "trace" in ev:
            body["trace"] = ev["trace"]
        return web.json_response(body)
    finally:
        gw.scheduler.cancel(seq)  # no-op when finished; frees KV slots when the client went away


async def _stream_sse(request, seq: Sequence, spec: GenerationSpec, chat: bool, base: dict) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)

    async def send(obj) -> None:
        await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

    def chunk(delta_or_text, finish=None, lp=None) -> dict:
        if chat:
            choice = {"index": 0, "delta": delta_or_text, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": delta_or_text, "finish_reason": finish, "logprobs": lp}
        return {**base, "choices": [choice]}

    if chat:
        await send(chunk({"role": "assistant", "content": ""}))
    while True:
        ev = await seq.events.get()
        if ev["type"] == "token":
            if ev["text"] or spec.logprobs:
                lp = _logprobs_field(chat, [ev]) if spec.logprobs else None
                await send(chunk({"content": ev["text"]} if chat else ev["text"], lp=lp))
        elif ev["type"] == "error":
            await send({"error": {"message": ev["message"], "type": "server_error", "code": ev["code"]}})
            break
        else:
            await send(chunk({} if chat else "", finish=ev["finish_reason"]))
            if spec.include_usage:
                await send({**base, "choices": [], "usage": ev["usage"]})
            break
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response({"object": "list", "data": [{"id": gw.config.model_id, "object": "model", "created": 0,
                                                          "owned_by": "stagemesh"}]})


# ---- websocket -------------------------------------------------------------------------------------------------------

async def stream_ws(request: web.Request) -> web.WebSocketResponse:
    """Several generations per socket, each with its own id. See the README for the protocol."""
    gw = request.app[GATEWAY]
    ws = web.WebSocketResponse(max_msg_size=MAX_WS_MESSAGE, heartbeat=30)
    await ws.prepare(request)
    active: dict[str, tuple[Sequence, asyncio.Task]] = {}

    async def pump(rid: str, seq: Sequence) -> None:
        try:
            while True:
                ev = await seq.events.get()
                await ws.send_json({**ev, "id": rid})
                if ev["type"] != "token":
                    break
        finally:
            active.pop(rid, None)

    async def error(rid, code: str, message: str) -> None:
        await ws.send_json({"type": "error", "id": rid, "code": code, "message": message})

    try:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                await ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"send JSON text frames, not binary")
                break
            if msg.type != WSMsgType.TEXT:
                continue
            try:
                data = json.loads(msg.data)
            except json.JSONDecodeError as e:
                await error(None, "invalid_json", f"not valid JSON: {e.msg}")
                continue
            if not isinstance(data, dict):
                await error(None, "invalid_request", "each message must be a JSON object with a 'type'")
                continue
            rid, kind = data.get("id"), data.get("type")
            if not isinstance(rid, str) or not (0 < len(rid) <= 128):
                await error(None, "invalid_request", "'id' must be a string of 1..128 characters")
                continue
            if kind == "cancel":
                if rid in active:
                    gw.scheduler.cancel(active[rid][0])
                else:
                    await error(rid, "unknown_id", f"no running generation with id {rid!r}")
            elif kind == "generate":
                if rid in active:
                    await error(rid, "duplicate_id", f"a generation with id {rid!r} is already running")
                    continue
                if len(active) >= MAX_STREAMS_PER_SOCKET:
                    await error(rid, "too_many_streams", f"at most {MAX_STREAMS_PER_SOCKET} generations per socket")
                    continue
                try:
                    chat = "messages" in data
                    spec = parse_generation(data, chat, gw.pipeline.max_seq_len or 1 << 20)
                    seq = await gw.prepare(spec)
                    gw.submit(seq)
                except RequestError as e:
                    gw.metrics.rejected.labels(str(e.status)).inc()
                    await error(rid, e.code, e.message)
                    continue
                active[rid] = (seq, asyncio.create_task(pump(rid, seq)))
            else:
                await error(rid, "unknown_type", f"unknown message type {kind!r}; use 'generate' or 'cancel'")
    finally:
        for seq, task in list(active.values()):
            gw.scheduler.cancel(seq)
            task.cancel()
    if ws.close_code == WSCloseCode.MESSAGE_TOO_BIG:
        log.info("websocket closed: a frame exceeded %d bytes", MAX_WS_MESSAGE)
    return ws


# ---- probes, metrics, page -------------------------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    p = request.app[GATEWAY].pipeline
    body = {"ready": p.ready, "problem": p.problem, "stages": p.stage_urls}
    return web.json_response(body, status=200 if p.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[GATEWAY].metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(os.path.join(STATIC, "index.html"))


async def _background(app: web.Application):
    gw = app[GATEWAY]
    await gw.pipeline.start()
    task = asyncio.create_task(gw.scheduler.run(), name="scheduler")
    yield
    gw.scheduler.shutdown()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await gw.pipeline.close()


def make_app(files: ModelFiles, pipeline: Pipeline, config: GatewayConfig, max_inflight: int,
             max_queue: int = 256, prefill_chunk: int = 128, token_budget: int = 512) -> web.Application:
    metrics_ = GatewayMetrics()
    scheduler = Scheduler(pipeline, metrics_, max_inflight=max_inflight, max_queue=max_queue,
                          prefill_chunk=prefill_chunk, token_budget=token_budget)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors_middleware])
    app[GATEWAY] = Gateway(files, pipeline, scheduler, metrics_, config)
    app.cleanup_ctx.append(_background)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/stream", stream_ws)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", index)
    return app

