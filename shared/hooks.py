"""The pipeline's hooks, split by concern. Each has one real implementation that the stage uses:

- LayerHook            on_layer_input / on_layer_output           -> shared.trace.CaptureHook (tracing)
- PipelineTransport    send_activation / receive_activation / receive_response -> shared.transport.ZmqTransport
- PipelineLifecycle    init_pipeline_request (once per request) / release -> shared.runtime.StageRuntime
- AsyncPipelineHook    the stage loop's view: try_prefetch_input, receive, send, layer_range, position
                                                                  -> PrefetchingHook below
An absent optional capability raises a clear error (CapabilityMissing, MissingActivation); nothing silently succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Hashable
from typing import Protocol, runtime_checkable

from shared.layers import LayerRange, StagePosition
from shared.models import LayerHook
from shared.protocol import Message

log = logging.getLogger("stagemesh.hooks")


@runtime_checkable
class PipelineTransport(Protocol):
    async def send_activation(self, msg: Message) -> None: ...

    async def receive_activation(self) -> Message: ...

    async def receive_response(self) -> Message: ...


@runtime_checkable
class PipelineLifecycle(Protocol):
    def init_pipeline_request(self, seq_id: Hashable) -> int: ...

    def release(self, seq_id: Hashable) -> bool: ...


class AsyncPipelineHook(Protocol):
    layer_range: LayerRange
    position: StagePosition

    def try_prefetch_input(self) -> Message | None: ...

    async def receive(self) -> Message: ...

    async def send(self, msg: Message) -> None: ...


class PrefetchingHook:
    """AsyncPipelineHook over a PipelineTransport.

    With prefetch on, a receiver task keeps pulling validated messages into a bounded queue while the current
    micro-batch computes, and a sender task drains a queue of outgoing messages, so a send never blocks compute.
    With prefetch off, receive and send happen inline, one after the other (the baseline the benchmark compares)."""

    def __init__(self, transport: PipelineTransport, layer_range: LayerRange, position: StagePosition,
                 prefetch: bool = True, depth: int = 4):
        self.transport = transport
        self.layer_range = layer_range
        self.position = position
        self.prefetch = prefetch
        self.inbox: asyncio.Queue[Message] = asyncio.Queue(maxsize=depth)
        self.outbox: asyncio.Queue[Message] = asyncio.Queue()
        self.send_seconds = 0.0
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        if self.prefetch:
            self._tasks = [asyncio.create_task(self._receiver(), name="receiver"),
                           asyncio.create_task(self._sender(), name="sender")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _receiver(self) -> None:
        while True:
            await self.inbox.put(await self.transport.receive_activation())

    async def _sender(self) -> None:
        while True:
            msg = await self.outbox.get()
            t0 = time.perf_counter()
            try:
                await self.transport.send_activation(msg)
            except Exception:
                log.exception("send failed; message dropped")
            self.send_seconds += time.perf_counter() - t0

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
        return await self.transport.receive_activation()

    async def send(self, msg: Message) -> None:
        if self.prefetch:
            self.outbox.put_nowait(msg)
        else:
            t0 = time.perf_counter()
            await self.transport.send_activation(msg)
            self.send_seconds += time.perf_counter() - t0


__all__ = ["AsyncPipelineHook", "LayerHook", "PipelineLifecycle", "PipelineTransport", "PrefetchingHook"]
