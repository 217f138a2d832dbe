"""The gateway's aiohttp application, composed: the error middleware (host, origin, API key, content type), probes,
metrics, the chat page, the routes and the app factory. The request lifecycle (Gateway) lives in core.py, the OpenAI
handlers in openai_api.py and responses_api.py, the Anthropic Messages handlers in anthropic_api.py, the
websocket in ws.py, the mesh view in mesh_view.py."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.api.anthropic import MESSAGES_PATH, count_message_tokens, create_message
from services.gateway.api.join import add_join_api
from services.gateway.api.mesh_view import add_mesh_view
from services.gateway.api.openai import chat_completions, completions, models, resume_stream
from services.gateway.api.response_store import MemoryResponseStore
from services.gateway.api.responses import add_responses_api, readopted_into
from services.gateway.api.ws import stream_ws
from services.gateway.config import API_KEY_ENV, OPERATOR_KEY_ENV, OPERATOR_PATHS, GatewayConfig
from services.gateway.engine.balance import Balancer, StartSplit
from services.gateway.engine.core import Engine
from services.gateway.engine.membership import Membership
from services.gateway.engine.metrics import (
    GatewayMetrics,
    summed_transport,
    watch_prefix_cache,
    watch_replicas,
    watch_speculation,
    watch_transport,
)
from services.gateway.engine.pipeline import Pipeline
from services.gateway.engine.replicas import Replica, Replicas
from services.gateway.engine.speculator import Speculator
from services.gateway.frontend.durable import FLUSH_S, TAKE_OVER_S, RequestStore
from services.gateway.frontend.frontend import GATEWAY, Gateway
from services.gateway.frontend.schemas import RequestError
from shared.config import SCHEDULER_DEFAULTS, SchedulerConfig
from shared.observe.log_throttle import OneLineThrottleFilter, throttled
from shared.observe.otlp import OtlpTracer
from shared.runtime.model_files import ModelFiles
from shared.runtime.plan import ModelFacts

log = logging.getLogger("stagemesh.gateway")

STATIC = os.path.join(os.path.dirname(__file__), "static")
MAX_BODY_BYTES = 1 << 20


def _error(request: web.Request, e: RequestError, headers: dict | None = None) -> web.Response:
    """The error in the shape of the API asked: Anthropic's under /v1/messages, OpenAI's everywhere else."""
    anthropic = request.path == MESSAGES_PATH or request.path.startswith(MESSAGES_PATH + "/")
    return web.json_response(e.anthropic_body() if anthropic else e.openai_body(), status=e.status, headers=headers)


def _key_matches(given: str, key: str) -> bool:
    """Timing-safe compare of any text a client sends (non-ASCII included) against the key: compared as UTF-8
    bytes ("surrogatepass" never fails), so no input can raise."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass"))


WS_PATH = "/v1/stream"
JSON_POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", MESSAGES_PATH,
              MESSAGES_PATH + "/count_tokens", "/v1/mesh/resplit",
              "/v1/mesh/replace")
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version"
HTTP_LOG = "stagemesh.gateway.http"  # aiohttp's per-connection logger: one line per reason per interval


def host_allowed(config: GatewayConfig, host: str | None) -> bool:
    """DNS rebinding guard (as Jupyter and webpack-dev-server do): a page on an attacker's name that resolves to this
    gateway is "same-origin" by its Host, so the name in Host must be one this gateway answers to: an IP address (a
    rebinding needs a name), localhost or a *.localhost name, the address it listens on, or one of --allow-host
    ("*" = any; ".example.com" = example.com and every name below it). No Host header at all names nothing: allowed."""
    if host is None or "*" in config.allow_hosts:
        return True
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name == "localhost" or name.endswith(".localhost") or (config.bind_host and name == config.bind_host.lower()):
        return True
    return any(name == a or (a.startswith(".") and (name.endswith(a) or name == a[1:])) for a in config.allow_hosts)


def _check_host(request: web.Request) -> None:
    host = request.headers.get("Host")
    if not host_allowed(request.app[GATEWAY].config, host):
        raise RequestError(f"Host {host[:100]!r} is not a name this gateway answers to (a page on another name that "
                           "resolves here -- DNS rebinding -- is refused); use its IP address or localhost, or start "
                           "the gateway with --allow-host NAME", status=403, code="host_not_allowed")


def _own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}".lower()


def origin_allowed(request: web.Request, origin: str) -> bool:
    """Same-origin by default: a browser page may call only the gateway that served it, unless --allow-origin
    names its origin (or "*")."""
    allowed = request.app[GATEWAY].config.allow_origins
    o = origin.strip().lower().rstrip("/")
    if "*" in allowed or o in allowed:
        return True
    parts = urlsplit(o)
    return bool(parts.scheme and parts.netloc) and o == _own_origin(request)


QUERY_KEY_PATHS = (WS_PATH, "/v1/mesh/stream")  # a websocket and an EventSource: no way to set a header


def _sent_key(request: web.Request, key: str) -> bool:
    """Whether the request carries `key`: as its bearer token, in x-api-key, or (on QUERY_KEY_PATHS only) ?api_key=."""
    given = request.headers.get("Authorization", "")
    if not given and request.path in QUERY_KEY_PATHS:  # browsers cannot set headers on these: the query, here only
        given = f"Bearer {request.query.get('api_key', '')}"
    # RFC 7235: the scheme is case-insensitive ("bearer" is "Bearer"), then one or more spaces, then the token
    scheme, _, token = given.strip().partition(" ")
    bearer = _key_matches(scheme.lower(), "bearer") & _key_matches(token.strip(), key)
    x_api_key = request.headers.get("x-api-key")  # Anthropic's header (its SDK and agents send it), on every route
    return bool(bearer | (x_api_key is not None and _key_matches(x_api_key, key)))


def _check_key(request: web.Request) -> None:
    cfg = request.app[GATEWAY].config
    if request.path in OPERATOR_PATHS and (cfg.operator_key or cfg.api_key):  # changes the mesh: an operator's
        if not cfg.operator_key:
            raise RequestError(f"{request.path} changes the mesh: it needs the operator key, and this gateway has "
                               f"none: start it with {OPERATOR_KEY_ENV} set (a client's API key cannot do this)",
                               status=403, code="operator_key_required")
        if not _sent_key(request, cfg.operator_key):
            raise RequestError(f"missing or wrong operator key on {request.path}: send 'Authorization: Bearer <key>' "
                               f"with the gateway's {OPERATOR_KEY_ENV}", status=401, code="invalid_operator_key")
        return
    needs_key = request.path.startswith("/v1/") or (cfg.metrics_require_key and request.path == "/metrics")
    if not cfg.api_key or not needs_key:
        return
    if not _sent_key(request, cfg.api_key):
        hint = " (or ?api_key= on the websocket and the mesh stream)" if request.path in QUERY_KEY_PATHS else ""
        raise RequestError(f"missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'{hint} "
                           f"({API_KEY_ENV})", status=401, code="invalid_api_key")


def _check_content_type(request: web.Request) -> None:
    """JSON endpoints take JSON: a form or text/plain body is what a cross-site page can send without a
    preflight, so it is refused. A request without a Content-Type (some SDKs, curl --data-binary) is parsed."""
    ctype = request.headers.get("Content-Type")
    if request.method == "POST" and request.path in JSON_POSTS and ctype is not None:
        mime = ctype.split(";")[0].strip().lower()
        if not (mime == "application/json" or mime.endswith("+json")):
            raise RequestError(f"Content-Type {mime!r} is not accepted: send 'Content-Type: application/json'",
                               status=415, code="unsupported_media_type")


def _preflight(request: web.Request, origin: str) -> web.Response:
    """The answer to a CORS preflight from an allowed origin (the caller checked it)."""
    wanted = request.headers.get("Access-Control-Request-Headers")
    return web.Response(status=204, headers={
        "Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Allow-Methods": CORS_METHODS,
        "Access-Control-Allow-Headers": wanted if wanted and len(wanted) < 512 else CORS_HEADERS,
        "Access-Control-Max-Age": "600"})


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer to an allowed cross-origin request (SSE streams included, whose headers
    leave before the handler returns) carries the CORS headers."""
    origin = request.headers.get("Origin")
    if origin and request.app[GATEWAY].config.allow_origins and origin.strip().lower().rstrip("/") != \
            _own_origin(request) and origin_allowed(request, origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers.add("Vary", "Origin")


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Host (DNS rebinding), origin policy, API key and content type, then the handler. Every error leaves in
    OpenAI's shape (Anthropic's under /v1/messages) with a message that says what to fix; an unexpected exception becomes a 500 in that shape, logged
    (throttled). The origin policy trusts Host for the gateway's own origin only because it was checked first."""
    try:
        _check_host(request)
        origin = request.headers.get("Origin")
        if origin is not None and not origin_allowed(request, origin):
            raise RequestError(f"origin {origin[:100]!r} may not use this gateway: pages of other origins are "
                               "refused; start the gateway with --allow-origin ORIGIN to allow one",
                               status=403, code="origin_not_allowed")
        if request.method == "OPTIONS" and origin is not None and request.headers.get("Access-Control-Request-Method"):
            return _preflight(request, origin)
        _check_key(request)
        _check_content_type(request)
        return await handler(request)
    except RequestError as e:
        request.app[GATEWAY].metrics.rejected.labels(str(e.status)).inc()
        return _error(request, e, {"Retry-After": "1"} if e.status in (429, 503) else None)
    except web.HTTPRequestEntityTooLarge:
        return _error(request, RequestError(f"request body exceeds {MAX_BODY_BYTES} bytes", status=413,
                                            code="body_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(request, RequestError(f"{e.reason}: {request.method} {request.path}", status=e.status,
                                            code="http_error"))
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client went away: nobody to answer
    except Exception as e:
        throttled(log, logging.ERROR, f"500:{type(e).__name__}", "internal error on %s %s: %s: %s", request.method,
                  request.path, type(e).__name__, e, exc_info=e)
        request.app[GATEWAY].metrics.rejected.labels("500").inc()
        return _error(request, RequestError(f"internal error ({type(e).__name__}); the gateway logged it",
                                            status=500, code="internal_error"))


# ---- probes, metrics, page -------------------------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    serving = bool(gw.replicas.ready)
    is_ready = serving and not gw.draining
    reason = "draining" if gw.draining else None if serving else "pipeline"
    body = {"ready": is_ready, "reason": reason, "problem": gw.replicas.problem,
            "stages": [u for r in gw.replicas.all for u in r.pipeline.stage_urls]}
    if len(gw.replicas.all) > 1:
        body["pipelines"] = gw.replicas.info()
    return web.json_response(body, status=200 if is_ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[GATEWAY].metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


# The page loads only its own files (static/, the vendored libraries included): no inline script or style, no eval;
# its websocket and fetches go to this gateway only.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(os.path.join(STATIC, "index.html"), headers={"Content-Security-Policy": PAGE_CSP})


async def _flush_log(store: RequestStore) -> None:
    """The durable request log's writes, batched every FLUSH_S (a crash loses at most that much, regenerated), in a
    worker thread: a slow disk, or a Redis far away or gone, never holds the event loop."""
    while True:
        await asyncio.sleep(FLUSH_S)
        try:
            await asyncio.to_thread(store.flush)
        except Exception as e:  # a full disk, Redis away: the serving goes on, the batch waits for the next flush
            throttled(log, logging.ERROR, "request_log", "the request log could not be written: %s: %s",
                      type(e).__name__, e)


async def _take_over(gw: Gateway) -> None:
    """A shared log (Redis): every TAKE_OVER_S, the requests of gateways whose lease ran out, re-adopted here."""
    while True:
        await asyncio.sleep(TAKE_OVER_S)
        try:
            if n := await gw.take_over():
                log.warning("took over %d requests from a gateway that stopped renewing its lease", n)
        except Exception as e:  # Redis away for a moment must not stop the serving
            throttled(log, logging.ERROR, "take_over", "taking over requests failed: %s: %s", type(e).__name__, e)


async def _background(app: web.Application):
    gw = app[GATEWAY]
    replicas = gw.replicas.all
    await asyncio.gather(*(r.pipeline.start() for r in replicas))
    tasks = [asyncio.create_task(r.engine.run(), name=f"scheduler-{r.name}") for r in replicas]
    if gw.store is not None:
        tasks += [asyncio.create_task(_flush_log(gw.store), name="request-log"),
                  asyncio.create_task(gw.readopt(), name="readopt")]
        if gw.store.shared:
            tasks.append(asyncio.create_task(_take_over(gw), name="take-over"))
    yield
    gw.replicas.shutdown()  # a no-op after Gateway.drain, which ends requests while connections are still open
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for r in replicas:
        await r.pipeline.close()
    gw.lanes.close()
    if gw.store is not None:
        gw.store.close()
    otlp = replicas[0].engine.otlp  # one tracer for every engine
    if otlp is not None:
        await asyncio.sleep(0)  # let the closed client's futures end their micro-batch spans first
        otlp.shutdown()  # exports the spans still queued (bounded by the export timeout)


def make_app(files: ModelFiles, pipelines: Pipeline | list[Pipeline], config: GatewayConfig, max_inflight: int,
             scheduling: SchedulerConfig = SCHEDULER_DEFAULTS, otlp: OtlpTracer | None = None,
             store: RequestStore | None = None, split_auto: bool = False,
             join_token: str | None = None) -> web.Application:
    """`pipelines`: one, or several replicas of the same model (each gets its own scheduler and prefix index).
    max_inflight: micro-batches in flight per pipeline (scheduling.max_inflight, or the number of stages).
    split_auto: each pipeline moves to the split its stages' calibrations balance before it counts as ready.
    join_token: hosts that prove it join the (one) pipeline as new stages (services/gateway/api/join.py)."""
    pipelines = [pipelines] if isinstance(pipelines, Pipeline) else list(pipelines)
    metrics_ = GatewayMetrics()
    watch_transport(metrics_, summed_transport(pipelines))
    speculator = Speculator(scheduling.speculation)  # one n-gram pool for every pipeline
    watch_speculation(metrics_, speculator)
    facts = ModelFacts.from_gguf(files.loader, kv_itemsize=4) if scheduling.auto_rebalance or split_auto else None

    def balancer() -> Balancer | None:  # --auto-rebalance's policy, one per pipeline
        return Balancer(facts, scheduling.rebalance_window_s, scheduling.rebalance_gain) \
            if scheduling.auto_rebalance else None

    # The engines come first; the replicas over them and the front end over those close the two upward edges an
    # engine has (named below, resolved when called): its requests' outputs go to the front end (Gateway.deliver),
    # and while its pipeline is not ready its open requests go to another replica (Replicas.take_over).
    replicas: Replicas
    gateway: Gateway

    def engine(name: str, p: Pipeline) -> Engine:
        return Engine(p, metrics_, max_inflight=max_inflight, config=scheduling, otlp=otlp, speculator=speculator,
                      balancer=balancer(), start_split=StartSplit(facts) if split_auto else None,
                      on_output=lambda req, out: gateway.deliver(req, out),
                      handoff=lambda reqs: replicas.take_over(reqs, replicas.by_name[name]))

    replicas = Replicas([Replica(f"p{i}", p, engine(f"p{i}", p)) for i, p in enumerate(pipelines)], metrics_)
    indexes = [r.scheduler.prefix for r in replicas.all if r.scheduler.prefix is not None]
    if indexes:
        watch_prefix_cache(metrics_, indexes)
    watch_replicas(metrics_, replicas)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors_middleware])
    responses = MemoryResponseStore(config.stored_responses, config.stored_responses_ttl_s)
    gateway = Gateway(files, replicas, metrics_, config, store=store, on_readopt=readopted_into(responses))
    app[GATEWAY] = gateway
    app.cleanup_ctx.append(_background)
    app.on_response_prepare.append(_cors_headers)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post(MESSAGES_PATH, create_message)  # Anthropic's Messages API (docs/messages.md)
    app.router.add_post(MESSAGES_PATH + "/count_tokens", count_message_tokens)
    app.router.add_get("/v1/streams/{id}", resume_stream)
    add_responses_api(app, responses)
    app.router.add_get("/v1/stream", stream_ws)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", index)
    app.router.add_static("/static", STATIC)  # the page's scripts, styles and vendored libraries (static/vendor)
    add_mesh_view(app, app[GATEWAY])  # GET /v1/mesh, /v1/mesh/stream: the page's #mesh view, `stagemesh status`
    if join_token is not None:  # POST /join...: hosts that join and leave the running mesh
        add_join_api(app, Membership(join_token, replicas.all[0].engine.mesh, files.config.head_cost_in_layers,
                                     config.join_ready_timeout_s))
    return app



def make_runner(app: web.Application) -> web.AppRunner:
    """The runner for `app` with the edge timeouts: idle keep-alive, which aiohttp (>= 3.10) also arms when a
    connection opens, so a client that sends no request, or trickles its headers, is closed after it."""
    http_log = logging.getLogger(HTTP_LOG)
    if not any(isinstance(f, OneLineThrottleFilter) for f in http_log.filters):
        http_log.addFilter(OneLineThrottleFilter())  # malformed HTTP: one line per reason, not a traceback each
    return web.AppRunner(app, handler_cancellation=True, access_log=None, logger=http_log,
                         keepalive_timeout=app[GATEWAY].config.keepalive_timeout_s)


async def serve_until_signal(app: web.Application, host: str, port: int,
                             started: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain (Gateway.drain) and only then close connections. `started` runs
    alongside (the `up` supervisor) and is cancelled at the signal."""
    gw = app[GATEWAY]
    gw.config = replace(gw.config, bind_host=host)  # a name it listens on is a name it answers to (host_allowed)
    runner = make_runner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    side = asyncio.create_task(started()) if started else None
    try:
        await stop.wait()
        if side is not None:
            side.cancel()
        print(f"stopping: draining running requests (up to {gw.config.drain_timeout_s:g} s) ...", flush=True)
        await gw.drain(gw.config.drain_timeout_s)
    finally:
        await runner.cleanup()
