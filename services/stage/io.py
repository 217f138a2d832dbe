"""StageIO: the stage's view of its sockets. The event loop prefetches inputs while the compute thread computes, and
the compute thread sends each output the moment it has it.

- **Receive, on the event loop.** One reader callback watches the inbound socket. When it fires, the callback takes
  every valid message waiting there (ZmqTransport.receive_nowait decodes and validates each one) and hands it to the
  compute thread's queue, `inputs`. Inputs handed over and not yet finished are bounded by `limit`: depth prefetched
  plus the one computing, or 1 with prefetch off. At the bound the callback stops reading, and the socket's own queue
  holds the rest. When the compute thread finishes one, it wakes the callback again.
- **Compute and send, on the compute thread.** It takes `inputs` in order and computes. It hands each output to
  ZeroMQ's queue for the next hop (ZmqTransport.send_from_thread), whose I/O thread writes it out. The compute thread is
  the outbound socket's only user.

Nothing on the hot path waits for the event loop to wake: between a message's arrival and its compute there is one
hand-off (loop to compute thread), and none after it. With prefetch off, the next input is read only after the current
one is finished and sent (the baseline the overlap benchmark compares)."""

from __future__ import annotations

import asyncio
import logging
import queue

from shared.wire.protocol import Message
from shared.wire.transport import ZmqTransport

log = logging.getLogger("stagemesh.stage.io")

STOP = None  # put on `inputs` to end the compute thread's serving loop after what it is computing


class StageIO:
    def __init__(self, transport: ZmqTransport, prefetch: bool = True, depth: int = 4):
        self.transport = transport
        self.prefetch = prefetch
        self.limit = depth + 1 if prefetch else 1  # inputs handed to the compute thread and not yet finished
        self.inputs: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        # each counter has one writer (handed: the loop; finished: the compute thread), so neither needs a lock
        self.handed = 0
        self.finished = 0
        self._paused = False  # the reader stopped at the bound; the compute thread's next finish wakes it
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self.transport.watch_handshakes(), name="handshakes")]
        self._loop.add_reader(self.transport.inbound_fd, self._read)
        self._read()  # whatever arrived before the reader was added (the fd is edge-triggered)

    async def stop(self) -> None:
        self._stopped = True  # a wake-up from finish_one still queued on the loop reads nothing more
        if self._loop is not None:
            self._loop.remove_reader(self.transport.inbound_fd)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _read(self) -> None:
        """On the loop: hand every waiting message to the compute thread, up to the bound."""
        self._paused = False
        if self._stopped:
            return
        while True:
            if self.handed - self.finished >= self.limit:
                self._paused = True
                if self.handed - self.finished >= self.limit:
                    return  # still at the bound: finish_one (which reads _paused after counting) wakes this again
                self._paused = False
            try:
                msg = self.transport.receive_nowait()
            except Exception:  # not a malformed message (those are counted and dropped inside): a broken socket
                log.exception("reading the inbound socket failed; the next arrival reads on")
                return
            if msg is None:
                return
            self.handed += 1
            self.inputs.put(msg)

    def finish_one(self) -> None:
        """On the compute thread, once an input is finished (and its output sent)."""
        self.finished += 1
        if self._paused:
            self._loop.call_soon_threadsafe(self._read)

    @property
    def queue_depth(self) -> int:
        """Inputs received and waiting for the compute thread."""
        return self.inputs.qsize()

    def send(self, msg: Message, via: str | None = None) -> bool:
        """On the compute thread only (the outbound socket's one user): hand msg to the next hop (`via`: the next-hop
        instance of that id, ZmqTransport.hops). False: dropped, the next hop took nothing for ZmqTransport's
        patience (logged and counted there)."""
        try:
            return self.transport.send_from_thread(msg, via=via)
        except Exception:
            log.exception("send failed; message dropped")
            return False
