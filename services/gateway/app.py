"""The gateway's aiohttp application: the Gateway object the handlers share, the error middleware, probes,
metrics, the chat page, and the app factory. The OpenAI handlers live in openai_api.py, the websocket in ws.py."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.metrics import GatewayMetrics
from services.gateway.output import OutputProcessor
from services.gateway.pipeline import Pipeline
from services.gateway.scheduler import QueueFull, Scheduler, Sequence, new_seq_id
from services.gateway.schemas import GenerationSpec, RequestError, parse_generation
from shared.config import SERVING_DEFAULTS, ServingConfig
from shared.errors import ChatTemplateError
from shared.model_files import ModelFiles

log = logging.getLogger("stagemesh.gateway")

STATIC = os.path.join(os.path.dirname(__file__), "static")
MAX_BODY_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 600.0


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
        return Sequence(seq_id=new_seq_id(), prompt_ids=ids, params=spec.sampling.with_seed(), max_tokens=max_tokens,
                        stop_ids=frozenset() if spec.ignore_eos else self.files.tokenizer.eos_ids,
                        deadline=time.perf_counter() + timeout, trace=spec.trace)

    def submit(self, seq: Sequence) -> None:
        try:
            self.scheduler.submit(seq)
        except QueueFull as e:
            raise RequestError(str(e), status=429, code="queue_full") from None

    async def start(self, body: dict, chat: bool) -> tuple[GenerationSpec, Sequence]:
        """Validate, tokenize and queue one generation request."""
        spec = parse_generation(body, chat, self.pipeline.max_seq_len or 1 << 20)
        seq = await self.prepare(spec)
        self.submit(seq)
        return spec, seq

    async def events(self, seq: Sequence, spec: GenerationSpec) -> AsyncIterator[dict]:
        """The request's client events, through the output processor, ending with its done or error event.
        A stop string ends the sequence here: the scheduler frees its slots and reports the finish."""
        proc = OutputProcessor(seq, self.files.tokenizer, spec.stop)
        while True:
            out = await seq.outputs.get()
            already_stopped = proc.stop_string_hit
            for ev in proc.process(out):
                yield ev
                if ev["type"] != "token":
                    return
            if proc.stop_string_hit and not already_stopped:
                self.scheduler.finish(seq, "stop")


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
             serving: ServingConfig = SERVING_DEFAULTS) -> web.Application:
    from services.gateway.openai_api import chat_completions, completions, models
    from services.gateway.ws import stream_ws

    metrics_ = GatewayMetrics()
    scheduler = Scheduler(pipeline, metrics_, max_inflight=max_inflight, config=serving)
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

