"""The websocket stream (/v1/stream): several generations per socket, each with its own id. See the README for
the protocol. One WsSession per socket; each generation's events are pumped by its own task."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import WSCloseCode, WSMsgType, web

from services.gateway.frontend.events import RequestHandle
from services.gateway.frontend.frontend import GATEWAY, Gateway
from services.gateway.frontend.schemas import RequestError, parse_json_text
from shared.observe.log_throttle import throttled

log = logging.getLogger("stagemesh.gateway.ws")

MAX_WS_MESSAGE = 1 << 20
MAX_STREAMS_PER_SOCKET = 64
MAX_REQUEST_ID_LEN = 128


class WsSession:
    def __init__(self, gw: Gateway, ws: web.WebSocketResponse):
        self.gw = gw
        self.ws = ws
        self.active: dict[str, tuple[RequestHandle, asyncio.Task]] = {}  # client's id -> its request, event pump

    async def run(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.BINARY:
                    await self.ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"send JSON text frames, not binary")
                    break
                if msg.type == WSMsgType.TEXT:
                    await self.on_message(msg.data)
        finally:
            for handle, task in list(self.active.values()):  # no await here: the handler itself may be cancelled
                task.cancel()
                self.gw.leave(handle)

    async def error(self, rid: str | None, code: str, message: str, param: str | None = None) -> None:
        event = {"type": "error", "id": rid, "code": code, "message": message}
        if param is not None:  # the request field at fault, as in the HTTP API's error body
            event["param"] = param
        await self.ws.send_json(event)

    async def on_message(self, text: str) -> None:
        """One client message. Whatever it holds, the socket and the client's other streams on it live on: a bad
        message gets an error event, an unexpected failure an "internal_error" event (logged, throttled)."""
        try:
            await self.on_text(text)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:
            throttled(log, logging.ERROR, f"ws:{type(e).__name__}", "websocket message failed: %s: %s",
                      type(e).__name__, e, exc_info=e)
            if not self.ws.closed:
                await self.error(None, "internal_error", f"internal error ({type(e).__name__}); the gateway logged it")

    async def on_text(self, text: str) -> None:
        try:
            data = parse_json_text(text)
        except RequestError as e:
            return await self.error(None, e.code, e.message)
        if not isinstance(data, dict):
            return await self.error(None, "invalid_request", "each message must be a JSON object with a 'type'")
        rid, kind = data.get("id"), data.get("type")
        if not isinstance(rid, str) or not (0 < len(rid) <= MAX_REQUEST_ID_LEN):
            return await self.error(None, "invalid_request", f"'id' must be a string of 1..{MAX_REQUEST_ID_LEN} characters")
        if kind == "cancel":
            await self.cancel(rid)
        elif kind == "generate":
            await self.generate(rid, data)
        elif kind == "resume":
            await self.resume(rid, data)
        else:
            await self.error(rid, "unknown_type", f"unknown message type {kind!r}; use 'generate', 'resume' or "
                                                  "'cancel'")

    async def cancel(self, rid: str) -> None:
        if rid not in self.active:
            return await self.error(rid, "unknown_id", f"no running generation with id {rid!r}")
        self.gw.replicas.cancel(self.active[rid][0].seq)

    async def generate(self, rid: str, data: dict) -> None:
        if rid in self.active:
            return await self.error(rid, "duplicate_id", f"a generation with id {rid!r} is already running")
        if len(self.active) >= MAX_STREAMS_PER_SOCKET:
            return await self.error(rid, "too_many_streams", f"at most {MAX_STREAMS_PER_SOCKET} generations per socket")
        try:
            body = {k: v for k, v in data.items() if k not in ("id", "type")}  # the envelope; the rest is OpenAI's
            if body.get("tools") is not None:  # calls are shaped into OpenAI's tool_calls by the HTTP API only
                raise RequestError("'tools' are served by POST /v1/chat/completions, not the websocket", "tools",
                                   code="unsupported_parameter")
            handle = await self.gw.start(body, chat="messages" in body)
        except RequestError as e:
            self.gw.metrics.rejected.labels(str(e.status)).inc()
            return await self.error(rid, e.code, e.message, e.param)
        self.active[rid] = (handle, asyncio.create_task(self.pump(rid, handle)))

    async def resume(self, rid: str, data: dict) -> None:
        """Follow a request again (one sent with "resumable": true, on this socket or another that closed): its
        events after offset `after` (every event carries its offset), under the new id `rid`."""
        if rid in self.active:
            return await self.error(rid, "duplicate_id", f"a generation with id {rid!r} is already running")
        request_id, after = data.get("request_id"), data.get("after", -1)
        handle = await self.gw.find(request_id) if isinstance(request_id, str) else None
        if handle is None:
            return await self.error(rid, "stream_not_found", f"no request {request_id!r} here: it never ran on this "
                                                             "gateway, or ended too long ago to be kept")
        if type(after) is not int or not -1 <= after < 1 << 30:
            return await self.error(rid, "invalid_request", "'after' must be the offset of the last event received "
                                                            "(-1: from the start)")
        self.active[rid] = (handle, asyncio.create_task(self.pump(rid, handle, after + 1)))

    async def pump(self, rid: str, handle: RequestHandle, start: int = 0) -> None:
        try:
            async with contextlib.aclosing(self.gw.events(handle, start)) as events:
                async for offset, ev in events:
                    await self.ws.send_json({**ev.to_json(), "id": rid, "request_id": handle.id, "offset": offset})
        finally:
            self.active.pop(rid, None)


async def stream_ws(request: web.Request) -> web.WebSocketResponse:
    gw = request.app[GATEWAY]
    ws = web.WebSocketResponse(max_msg_size=MAX_WS_MESSAGE, heartbeat=30)
    await ws.prepare(request)
    gw.websockets.add(ws)  # closed with "going away" after a drain
    try:
        await WsSession(gw, ws).run()
    finally:
        gw.websockets.discard(ws)
    if ws.close_code == WSCloseCode.MESSAGE_TOO_BIG:
        log.info("websocket closed: a frame exceeded %d bytes", MAX_WS_MESSAGE)
    return ws
