"""StageIO: the stage loop's view of its sockets -- prefetch the next input while the current one computes.

With prefetch on, a receiver task keeps pulling validated messages into a bounded inbox while the current
micro-batch computes, and a sender task drains an outbox, so a send never blocks compute. With prefetch off,
receive and send happen inline, one after the other (the baseline the overlap benchmark compares)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shared.protocol import Message
from shared.transport import ZmqTransport

log = logging.getLogger("stagemesh.stage.io")


class StageIO:
    def __init__(self, transport: ZmqTransport, prefetch: bool = True, depth: int = 4):
        self.transport = transport
        self.prefetch = prefetch
        self.inbox: asyncio.Queue[Message] = asyncio.Queue(maxsize=depth)
        self.outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self.transport.watch_handshakes(), name="handshakes")]
        if self.prefetch:
            self._tasks += [asyncio.create_task(self._receiver(), name="receiver"),
                            asyncio.create_task(self._sender(), name="sender")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _receiver(self) -> None:
        while True:
            await self.inbox.put(await self.transport.receive())

    async def _sender(self) -> None:
        while True:
            msg = await self.outbox.get()
            await self._send_now(msg)

    async def _send_now(self, msg: Message) -> None:
        try:
            await self.transport.send(msg)  # timed by the transport (TransportStats.sending_seconds)
        except Exception:
            log.exception("send failed; message dropped")

    @property
    def queue_depth(self) -> int:
        return self.inbox.qsize()

    def try_prefetch_input(self) -> Message | None:
        """The next input if it has already arrived; never waits."""
        try:
            return self.inbox.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def receive(self) -> Message:
        if self.prefetch:
            return await self.inbox.get()
        return await self.transport.receive()

    async def send(self, msg: Message) -> None:
        if self.prefetch:
            self.outbox.put_nowait(msg)
        else:
            await self._send_now(msg)
