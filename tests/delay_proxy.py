"""A user-space TCP proxy that delays every chunk by `delay` seconds in each direction (tc netem is not
available in this kernel). The delay can be changed while it runs; order is preserved."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time


class DelayProxy:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: float = 0.0):
        self.listen, self.target, self.delay = listen, target, delay
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, *self.listen)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((time.monotonic() + self.delay, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((0, None))
        with contextlib.suppress(Exception):
            await sender
        with contextlib.suppress(Exception):
            writer.close()

    async def _handle(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))


class ProxyThread:
    """Runs several DelayProxy on one event loop in a background thread."""

    def __init__(self, proxies: list[DelayProxy]):
        self.proxies = proxies
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        for p in self.proxies:
            asyncio.run_coroutine_threadsafe(p.start(), self.loop).result(10)

    def set_delay(self, seconds: float) -> None:
        for p in self.proxies:
            p.delay = seconds

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
