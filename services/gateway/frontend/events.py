"""What the gateway's front end keeps of a request beyond any one connection: its event log, numbered by offset,
and the handle that ties the log to the request the engine runs (vLLM v1's RequestState beside its core Request).

The engine reports each RequestOutput once (Gateway.deliver); the request's OutputProcessor turns it into client
events exactly once, and they are appended to its EventLog. Any number of readers follow the log from any offset
-- an HTTP response, a websocket stream, a reader that reconnects -- and none of them consumes it: a reader that
goes away takes nothing with it, and the next one re-reads from where it likes. Whether a request ends when its
last reader goes away is the request's own choice (RequestHandle.cancel_on_leave), not a side effect of a
handler returning."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.gateway.engine.request import Request
from services.gateway.frontend.output import END_EVENTS, ClientEvent, OutputProcessor, Usage
from services.gateway.frontend.schemas import GenerationSpec

KEEP_ENDED = 256  # ended requests whose logs stay readable (the most recently ended ones) ...
KEEP_ENDED_S = 600.0  # ... for at most this long after they ended (OpenAI keeps a background stream ~10 minutes)


class EventLog:
    """One request's client events in order; event i has offset i. Append-only, ended by one "done" or "error"
    event; read by following, from any offset, as often as anyone likes."""

    def __init__(self):
        self.events: list[ClientEvent] = []
        self._more = asyncio.Event()  # set (and replaced) by each append: wakes every follower at once

    @property
    def ended(self) -> bool:
        return bool(self.events) and isinstance(self.events[-1], END_EVENTS)

    def append(self, event: ClientEvent) -> int:
        """Add the next event; returns its offset."""
        if self.ended:
            raise RuntimeError(f"the log already ended with {self.events[-1].type!r}; nothing follows it")
        self.events.append(event)
        self._more.set()
        self._more = asyncio.Event()
        return len(self.events) - 1

    async def follow(self, start: int = 0) -> AsyncIterator[tuple[int, ClientEvent]]:
        """(offset, event) from offset `start` on, waiting for events not appended yet, until the end event."""
        if start < 0:
            raise ValueError(f"an offset is >= 0, got {start}")
        offset = start
        while True:
            more = self._more  # taken before reading the length: an append after this sets it
            while offset < len(self.events):
                event = self.events[offset]
                yield offset, event
                if isinstance(event, END_EVENTS):
                    return
                offset += 1
            await more.wait()


@dataclass(eq=False)
class RequestHandle:
    """The front end's side of one request: the request the engine runs (`seq`, the core's), what was asked
    (`spec`), the processor that makes its events and the log that keeps them. `cancel_on_leave`: a reader's end
    (Gateway.leave: the client went away or its handler returned) ends the request; False keeps it running for
    readers to come (a request that outlives its connection)."""

    seq: Request
    spec: GenerationSpec
    processor: OutputProcessor
    log: EventLog = field(default_factory=EventLog)
    cancel_on_leave: bool = True
    ended_at: float | None = None  # time.monotonic() when its end event was appended
    readers: int = 0  # readers following its log now (Gateway.events)
    kept: bool = True  # its log stays readable after it ends (RequestRegistry); False: dropped at its end, unread
    client: str = ""  # whose it is, for the per-client bound on unattended work (its API `user`; "": none given)
    detached: bool = False  # a background request: runs to its end with or without readers
    left: bool = False  # the connection that sent it is done with it (Gateway.leave)
    created: int = field(default_factory=lambda: int(time.time()))  # its responses' "created", on every reading

    @property
    def chat(self) -> bool:
        return self.spec.messages is not None

    @property
    def unattended(self) -> bool:
        """It runs with no connection waiting for it: a background request, or a resumable one whose connection
        went with no reader back since (what --max-detached-per-user bounds per client)."""
        return not self.log.ended and (self.detached or (self.left and self.readers == 0 and not self.cancel_on_leave))

    @property
    def id(self) -> str:
        return self.seq.seq_id

    def prompt_usage(self) -> Usage:
        """Its usage before anything is generated (the prefix cache's share of the prompt is known once it is
        admitted): what a surface shows as a stream starts."""
        return Usage.of(self.seq, 0)


class RequestRegistry:
    """The handles by request id: every open request's, and the KEEP_ENDED most recently ended ones for
    KEEP_ENDED_S after their end (their logs can still be re-read)."""

    def __init__(self, keep_ended: int = KEEP_ENDED, keep_ended_s: float = KEEP_ENDED_S):
        self.keep_ended, self.keep_ended_s = keep_ended, keep_ended_s
        self.open: dict[str, RequestHandle] = {}
        self.ended: OrderedDict[str, RequestHandle] = OrderedDict()  # oldest end first

    def add(self, handle: RequestHandle) -> None:
        self.open[handle.id] = handle

    def get(self, request_id: str) -> RequestHandle | None:
        self._forget_old()
        return self.open.get(request_id) or self.ended.get(request_id)

    def mark_ended(self, handle: RequestHandle, keep: bool = True) -> None:
        """The request ended: its handle kept with the recently ended ones (keep), or forgotten."""
        handle.ended_at = time.monotonic()
        if self.open.pop(handle.id, None) is not None and keep:
            self.ended[handle.id] = handle
        self._forget_old()

    def forget(self, request_id: str) -> None:
        """An ended request's handle, and with it its events, dropped now (an open one is the Gateway's to end)."""
        self.ended.pop(request_id, None)

    def _forget_old(self) -> None:
        now = time.monotonic()
        while self.ended and (len(self.ended) > self.keep_ended
                              or now - next(iter(self.ended.values())).ended_at > self.keep_ended_s):
            self.ended.popitem(last=False)
