"""ZeroMQ transport: every receiver binds a PULL, every sender connects a PUSH. Frames go out with copy=False
and come in as zmq.Frame buffers viewed as tensors. Malformed input is counted and dropped here, at the edge."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from shared.errors import StagemeshError
from shared.log_throttle import throttled
from shared.protocol import MAX_HEADER_BYTES, MAX_TENSOR_BYTES, Message, ProtocolError, decode, encode

log = logging.getLogger("stagemesh.transport")

HIGH_WATER_MARK = 64  # messages queued per socket before a send waits


def check_address(addr: str, flag: str) -> str:
    if not (addr.startswith("tcp://") or addr.startswith("ipc://") or addr.startswith("inproc://")):
        raise StagemeshError(f"{flag} {addr!r} must be a ZeroMQ address such as tcp://127.0.0.1:5551 or ipc:///tmp/stage0")
    return addr


def _bind_with_retry(sock: zmq.Socket, addr: str, patience_s: float = 3.0) -> None:
    """Bind, waiting briefly if a socket that just closed has not released the address yet (ZMQ closes
    asynchronously); a port held by someone else still fails with a clear error."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise StagemeshError(f"cannot bind {addr}: {e}") from None
            if time.monotonic() > deadline:
                raise StagemeshError(f"cannot bind {addr}: address already in use; choose another port") from None
            time.sleep(0.05)


class TransportStats:
    """Counters the owner exports (bytes, rejects by reason)."""

    def __init__(self):
        self.bytes_in = 0
        self.bytes_out = 0
        self.rejected: dict[str, int] = {}
        self.on_reject: Callable[[str], None] | None = None

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if self.on_reject:
            self.on_reject(reason)


class ZmqTransport:
    """An inbound PULL (bound) and an outbound PUSH (connected); `receive` returns only validated messages of the
    kinds this socket accepts."""

    def __init__(self, listen: str, next_hop: str | None, accept: tuple[type, ...], ctx: zmq.asyncio.Context | None = None):
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.stats = TransportStats()
        self.accept = accept
        self.inbound = self.ctx.socket(zmq.PULL)
        self.inbound.setsockopt(zmq.MAXMSGSIZE, MAX_TENSOR_BYTES + MAX_HEADER_BYTES)
        self.inbound.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self.inbound.setsockopt(zmq.LINGER, 0)
        _bind_with_retry(self.inbound, check_address(listen, "--listen"))
        self.outbound = None
        if next_hop:
            self.outbound = self.ctx.socket(zmq.PUSH)
            self.outbound.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
            self.outbound.setsockopt(zmq.LINGER, 0)
            self.outbound.connect(check_address(next_hop, "--next"))

    async def receive(self) -> Message:
        """The next valid message; malformed ones are counted under their reason and dropped."""
        while True:
            frames = await self.inbound.recv_multipart(copy=False)
            size = sum(len(f) for f in frames)
            self.stats.bytes_in += size
            try:
                msg = decode(frames)
                if not isinstance(msg, self.accept):
                    raise ProtocolError("kind", f"{type(msg).__name__} is not accepted on this socket")
                return msg
            except ProtocolError as e:
                self.stats.reject(e.reason)
                throttled(log, logging.WARNING, f"dropped:{e.reason}", "dropped a message of %d bytes in %d frames: %s", size, len(frames), e)

    async def send(self, msg: Message) -> None:
        if self.outbound is None:
            raise StagemeshError("this transport has no next hop to send to")
        frames = encode(msg)
        await self.outbound.send_multipart(frames, copy=False)
        self.stats.bytes_out += sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)

    def close(self) -> None:
        self.inbound.close(0)
        if self.outbound is not None:
            self.outbound.close(0)
