"""Server-sent events, written in one place for every surface (chat and completions, Messages, Responses, the mesh
view): the response and its headers, each event's lines (name, id, data), and the event-id cursors a
client sends back to resume (`Last-Event-ID`, or `?starting_after=`).

One id per SSE event, never shared: a stream's events are numbered 0, 1, 2, ... in the order they are written, and
the numbering is deterministic (each reading of a request's log shapes the same events in the same order), so
"after event n" names one place in the stream and a resumed reading sends exactly the events numbered above it. Two
id families, one parser each:
  chat / completions (/v1/streams): `<epoch>:<n>` -- the epoch (the gateway's, or its state directory's) says which
    run's numbering the n belongs to; a bare `<n>` is accepted as this epoch's;
  Responses: `<n>`, the event's `sequence_number` (OpenAI's own cursor)."""

from __future__ import annotations

import json

from aiohttp import web

from services.gateway.frontend.schemas import RequestError

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_NUMBER_DIGITS = 9  # an event number of a cursor: at most this many digits (a stream has far fewer events)


def frame(data: dict | str, event: str | None = None, id: str | int | None = None) -> bytes:
    """One SSE event's bytes: `event:` (its name), `id:` (what an EventSource sends back as Last-Event-ID), then
    `data:` (a dict as JSON on one line; a str as it is, e.g. "[DONE]")."""
    head = (f"event: {event}\n" if event is not None else "") + (f"id: {id}\n" if id is not None else "")
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class SSEStream:
    """One SSE response: `open` prepares it (HEADERS), `send` writes events, `close` ends it."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp

    @classmethod
    async def open(cls, request: web.Request) -> SSEStream:
        resp = web.StreamResponse(headers=HEADERS)
        await resp.prepare(request)
        return cls(resp)

    async def send(self, data: dict | str, event: str | None = None, id: str | int | None = None) -> None:
        await self.resp.write(frame(data, event, id))

    async def send_frames(self, frames: list[bytes]) -> None:
        """Several events in one write (what one engine event makes)."""
        if frames:
            await self.resp.write(b"".join(frames))

    async def close(self) -> web.StreamResponse:
        await self.resp.write_eof()
        return self.resp


def raw_cursor(request: web.Request) -> str | None:
    """The cursor a client resumes after: its `Last-Event-ID` header (what an EventSource sends when it reconnects,
    the newest it has), else `?starting_after=`; None when neither (or empty)."""
    return request.headers.get("Last-Event-ID") or request.query.get("starting_after") or None


def _number(text: str, cursor: str, what: str, param: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= MAX_NUMBER_DIGITS):
        raise RequestError(f"the cursor {cursor[:40]!r} is not {what}", param)
    return int(text)


def chat_cursor(request: web.Request, epoch: str) -> int:
    """A /v1/streams cursor, `<epoch>:<n>` (or `<n>`) -> n, the last event the client has; -1 without one. A cursor
    of another epoch is a 410: that run's numbering (and its events) is gone."""
    cursor = raw_cursor(request)
    if cursor is None:
        return -1
    cursor_epoch, _, n = cursor.rpartition(":")
    if cursor_epoch and cursor_epoch != epoch:
        raise RequestError(f"the cursor {cursor[:40]!r} is from another run of this gateway (it restarted since): "
                           "its events are gone", status=410, code="stream_expired")
    return _number(n, cursor, "an event id (`<epoch>:<n>`, as the stream's `id:` lines give it)", "Last-Event-ID")


def sequence_cursor(request: web.Request) -> int:
    """A Responses cursor (`starting_after`, or an EventSource's Last-Event-ID): the last sequence number the client
    has; -1 without one."""
    cursor = raw_cursor(request)
    if cursor is None:
        return -1
    return _number(cursor, cursor, "a sequence number (an integer >= 0)", "starting_after")


def past_the_end(after: int, last: int, param: str) -> RequestError:
    """The error both families send, as their stream's last event, when the cursor names an event after the
    stream's last one (`last`: its number; -1 for none): the client's place is wrong, not the stream complete."""
    return RequestError(f"{param} {after} is past this stream's last event (number {last})", param,
                        code="cursor_out_of_range")
