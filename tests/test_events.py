"""A request beyond its connection: the front end's event log (services/gateway/frontend/events.py).

The log's own rules first (offsets, any number of followers, one end); then the real Gateway over the real engine
loop, computing on a tiny GGUF behind the scheduler tests' recording client: two readers follow one request, one
leaves mid-way, the request goes on (it asked to outlive its readers), and after it ended a new reader re-reads it
from an offset and sees exactly what the first readers saw -- while a request that did not ask ends when its reader
leaves, as before."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.engine.metrics import GatewayMetrics
from services.gateway.engine.replicas import Replica, Replicas
from services.gateway.frontend.events import EventLog, RequestRegistry
from services.gateway.frontend.frontend import Gateway
from services.gateway.frontend.output import DoneEvent, TokenEvent, Usage
from shared.runtime.model_files import ModelFiles
from tests.test_scheduler import Harness

TOKENS = 12


async def test_followers_see_every_event_once_from_their_offset_and_wait_for_more():
    log = EventLog()
    first, second = [], []

    async def follow(into: list, start: int) -> None:
        async for offset, event in log.follow(start):
            into.append((offset, event.index if isinstance(event, TokenEvent) else event.type))

    readers = [asyncio.create_task(follow(first, 0)), asyncio.create_task(follow(second, 2))]
    for n in range(5):
        assert log.append(TokenEvent(n, f"t{n}", n, None)) == n
        await asyncio.sleep(0)  # followers run between appends: they wait for what is not there yet
    assert not log.ended
    log.append(DoneEvent("length", Usage(0, 0, 0), {}))
    await asyncio.wait_for(asyncio.gather(*readers), 5)
    assert first == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, "done")]
    assert second == first[2:]
    again = [item async for item in log.follow(4)]  # after the end: re-read, nothing waits
    assert [o for o, _ in again] == [4, 5] and log.ended
    with pytest.raises(RuntimeError, match="already ended"):
        log.append(TokenEvent(9, "", 9, None))
    with pytest.raises(ValueError, match=">= 0"):
        [item async for item in log.follow(-1)]


def test_ended_requests_are_kept_for_a_bounded_number_and_time(monkeypatch):
    import services.gateway.frontend.events as events

    class H:
        def __init__(self, rid: str):
            self.id, self.ended_at = rid, None

    reg = RequestRegistry(keep_ended=2, keep_ended_s=10.0)
    clock = [100.0]
    monkeypatch.setattr(events.time, "monotonic", lambda: clock[0])
    handles = [H(f"r{i}") for i in range(4)]
    for h in handles:
        reg.add(h)
    for h in handles[:3]:
        reg.mark_ended(h)
    assert reg.get("r0") is None and reg.get("r1") is handles[1] and reg.get("r3") is handles[3]  # the 2 latest
    clock[0] += 11.0
    assert reg.get("r1") is None and reg.get("r2") is None and reg.get("r3") is handles[3]  # open ones stay


class FrontEnd:
    """The real Gateway (events, leave, deliver) over the scheduler tests' engine, which computes each micro-batch
    on the tiny GGUF when told."""

    def __init__(self, path: str):
        self.h = Harness(path, on_output=lambda req, out: self.gw.deliver(req, out))  # the engine's outputs: the front end's
        replicas = Replicas([Replica("p0", self.h.pipeline, self.h.engine)], GatewayMetrics())
        self.gw = Gateway(ModelFiles.open(path), replicas, replicas.metrics, GatewayConfig(model_id="tiny"))

    async def run_until(self, done) -> None:
        """Compute what the engine sends, one micro-batch at a time (the readers run in between), until done()."""
        for _ in range(10 * TOKENS):
            await self.h.step()
            await asyncio.sleep(0)
            if done():
                return
            if self.h.client.sent:
                self.h.client.deliver()
        raise AssertionError("the request did not get there")


async def read(gw: Gateway, handle, start: int = 0, stop_after: int | None = None) -> list[tuple[int, dict]]:
    got = []
    async with contextlib.aclosing(gw.events(handle, start)) as events:
        async for item in events:
            got.append(item)
            if stop_after is not None and len(got) == stop_after:
                break  # this reader goes away, as a dropped connection does
    return got


async def test_a_request_followed_by_two_readers_outlives_one_and_is_re_read_after_it_ended(tiny_path):  # noqa: F811
    fe = FrontEnd(tiny_path)
    body = {"prompt": "the seam", "max_tokens": TOKENS, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    handle = await fe.gw.start(body, chat=False, cancel_on_leave=False)
    leaving = asyncio.create_task(read(fe.gw, handle, stop_after=4))
    staying = asyncio.create_task(read(fe.gw, handle))
    await fe.run_until(lambda: leaving.done())
    left = await leaving
    fe.gw.leave(handle)  # its handler ended: the request does not
    assert not handle.seq.done and fe.gw.open_streams == 1
    await fe.run_until(lambda: staying.done())
    whole = await staying
    assert [o for o, _ in whole] == list(range(len(whole))) and isinstance(whole[-1][1], DoneEvent)
    assert whole[-1][1].finish_reason == "length" and whole[-1][1].usage.completion_tokens == TOKENS
    assert left == whole[:4]  # the same events, not a share of them
    assert fe.gw.open_streams == 0 and not fe.gw.requests.open
    again = fe.gw.requests.get(handle.id)
    assert again is handle
    assert await read(fe.gw, again, start=5) == whole[5:]  # re-read from an offset, after every reader ended
    text = "".join(e.text for _, e in whole if isinstance(e, TokenEvent))
    assert text == fe.gw.files.tokenizer.decode(handle.seq.output_ids)  # once each, in order, nothing lost
    # the same request again, now ending with its only reader (the default): cancelled, its slot freed
    second = await fe.gw.start(body, chat=False)
    reader = asyncio.create_task(read(fe.gw, second, stop_after=2))
    await fe.run_until(lambda: reader.done())
    fe.gw.leave(second)
    assert second.seq.finish_reason == "cancelled" and second.log.ended
    assert second.log.events[-1].finish_reason == "cancelled"
    assert [e.token_id for e in second.log.events[:2]] == handle.seq.output_ids[:2]  # same seed, same tokens
