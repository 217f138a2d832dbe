"""The stage's HTTP endpoint: /health, /ready (weights loaded), /info, /metrics."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

WORKER = web.AppKey("worker", object)
LOAD_ERROR = web.AppKey("load_error", list)


def make_app() -> web.Application:
    app = web.Application()
    app[WORKER] = None
    app[LOAD_ERROR] = []

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        if app[WORKER] is None:
            status = {"ready": False, "reason": app[LOAD_ERROR][0] if app[LOAD_ERROR] else "loading weights"}
            return web.json_response(status, status=503)
        return web.json_response({"ready": True})

    async def info(request: web.Request) -> web.Response:
        if app[WORKER] is None:
            return web.json_response({"ready": False}, status=503)
        return web.json_response(app[WORKER].info().to_json())

    async def metrics(request: web.Request) -> web.Response:
        if app[WORKER] is None:
            return web.Response(text="", content_type="text/plain")
        body = generate_latest(app[WORKER].registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", metrics)
    return app
