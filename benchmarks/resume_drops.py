"""A resume after every chunk (issue 69, item 2's acceptance): --streams resumable chat streams with tools and
`stream_options.include_usage`, each read by a client that drops its connection after every chunk it reads -- the
role chunk, the first token's, each tool-call chunk, the final chunk, the usage chunk -- and reconnects with
`GET /v1/streams/{id}` and the chunk's id as `Last-Event-ID`; halfway through, `stagemesh up` is SIGKILLed (its stages
die with it) and started again on its --state-dir, and the clients keep reconnecting until it serves again.

Each stream's chunks as its client pieced them together are then checked, byte for byte (ids included), against the
same stream read whole from its start, and its text (content and tool calls) against the same seeded request run
undisturbed: 0 gaps (an event id skipped), 0 duplicates (one read twice), every text identical is the expectation.

    python -m benchmarks.resume_drops [--streams 32] [--stages 1] [--max-tokens 40] [--out DIR]"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import tempfile
import time

import aiohttp

from services.testing.harness import Report, add_out_arg, free_port
from services.testing.resumable import Deployment

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Dakar", "Perth"]
RETRY_S = 0.1  # a client's wait before it reconnects after a refused or broken connection


def body(i: int, max_tokens: int, resumable: bool, salt: str) -> dict:
    """Stream i: even ones ask for a tool call (SmolLM2-135M calls a tool, with tools auto, when asked to repeat
    one: greedy, so it is logged -- no grammar -- and survives the restart), odd ones for seeded text."""
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{CITIES[i // 2 % len(CITIES)]}"}}}}\n</tool_call>'
    ask = f"Repeat exactly this text and nothing else:\n{call}" if i % 2 == 0 else f"Tell me a story about day {i}."
    return {"messages": [{"role": "user", "content": ask}], "tools": TOOLS, "max_tokens": max_tokens,
            "temperature": 0 if i % 2 == 0 else 0.9, "seed": 1000 + i, "stream": True,
            "stream_options": {"include_usage": True}, "resumable": resumable, "cache_salt": salt}


async def read_frame(resp) -> bytes | None:
    """The next SSE event of a response, byte for byte (its lines and the blank line ending it); None at its end."""
    lines = []
    async for raw in resp.content:
        lines.append(raw)
        if raw == b"\n":
            return b"".join(lines)
    return None


def data(frame: bytes):
    text = frame.split(b"data: ", 1)[1].decode().rstrip("\n")
    return text if text == "[DONE]" else json.loads(text)


def event_id(frame: bytes) -> str | None:
    return frame[4:frame.index(b"\n")].decode() if frame.startswith(b"id: ") else None


def kind(frames: list[bytes], k: int) -> str:
    """What chunk k of a stream is: role, first token, tool call, content, final, usage, error or [DONE]."""
    d = data(frames[k])
    if d == "[DONE]":
        return "[DONE]"
    if "error" in d:
        return "error"
    if not d["choices"]:
        return "usage"
    choice = d["choices"][0]
    if choice["finish_reason"] is not None:
        return "final"
    if "role" in choice["delta"]:
        return "role"
    if k == 1:
        return "first token"
    return "tool call" if choice["delta"].get("tool_calls") else "content"


def text(frames: list[bytes]) -> str:
    """A stream's answer as a client assembles it: content, then each call's name and arguments, its finish."""
    parts = []
    for f in frames:
        d = data(f)
        if isinstance(d, dict) and d.get("choices"):
            delta, finish = d["choices"][0]["delta"], d["choices"][0]["finish_reason"]
            parts.append(delta.get("content") or "")
            for c in delta.get("tool_calls") or ():
                parts.append(f"<{c['index']}:{c.get('function', {}).get('name') or ''}>"
                             f"{c.get('function', {}).get('arguments') or ''}")
            parts.append(f"[{finish}]" if finish else "")
    return "".join(parts)


async def whole(s, url: str, b: dict) -> list[bytes]:
    async with s.post(url + "/v1/chat/completions", json=b) as r:
        frames = []
        while (f := await read_frame(r)) is not None:
            frames.append(f)
        return frames


class Client:
    """One stream read one chunk per connection: after each chunk the connection is dropped and the next one asks
    for what follows that chunk's id. Connections refused or cut (the gateway killed) are retried, not counted."""

    def __init__(self, i: int, max_tokens: int):
        self.i, self.max_tokens = i, max_tokens
        self.frames: list[bytes] = []
        self.rid: str | None = None
        self.reconnects = self.retries = 0
        self.statuses: collections.Counter = collections.Counter()

    async def run(self, s, url: str) -> None:
        while True:
            try:
                b = body(self.i, self.max_tokens, True, f"d{self.i}")
                async with s.post(url + "/v1/chat/completions", json=b) as r:
                    first = await read_frame(r)
                break
            except (aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(RETRY_S)
        self.frames.append(first)
        self.rid = data(first)["id"]
        while data(self.frames[-1]) != "[DONE]" and "error" not in data(self.frames[-1]):
            try:
                async with s.get(f"{url}/v1/streams/{self.rid}",
                                 headers={"Last-Event-ID": event_id(self.frames[-1])}) as r:
                    self.statuses[r.status] += 1
                    if r.status != 200:
                        self.retries += 1
                        await asyncio.sleep(RETRY_S)
                        continue
                    frame = await read_frame(r)
            except (aiohttp.ClientError, TimeoutError):
                self.retries += 1
                await asyncio.sleep(RETRY_S)
                continue
            if frame is None:  # the gateway went away mid-connection: ask again
                self.retries += 1
                continue
            self.frames.append(frame)
            self.reconnects += 1


async def drops(dep: Deployment, n: int, max_tokens: int, kill_after: int) -> tuple[list[Client], dict]:
    """Every client dropping after each chunk; the gateway SIGKILLed once `kill_after` chunks have been read in all,
    started again in a thread while the clients keep reconnecting."""
    clients = [Client(i, max_tokens) for i in range(n)]
    timing: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900, sock_read=120)) as s:
        tasks = [asyncio.create_task(c.run(s, dep.gw.url)) for c in clients]
        while sum(len(c.frames) for c in clients) < kill_after and not all(t.done() for t in tasks):
            await asyncio.sleep(0.02)
        timing["chunks_before_kill"] = sum(len(c.frames) for c in clients)
        dep.kill()
        t0 = time.monotonic()
        await asyncio.to_thread(dep.start)
        timing["restart_s"] = round(time.monotonic() - t0, 1)
        await asyncio.gather(*tasks)
    return clients, timing


async def check(url: str, clients: list[Client], ref: list[list[bytes]]) -> dict:
    """Each client's pieced-together chunks against the stream read whole from its start (bytes, ids included) and
    its text against the undisturbed run's."""
    gaps = duplicates = byte_identical = identical = 0
    dropped_after: collections.Counter = collections.Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        for c, undisturbed in zip(clients, ref):
            async with s.get(f"{url}/v1/streams/{c.rid}") as r:
                canonical = []
                while (f := await read_frame(r)) is not None:
                    canonical.append(f)
            numbers = [int(event_id(f).rpartition(":")[2]) for f in c.frames if event_id(f)]
            gaps += sum(b - a > 1 for a, b in zip(numbers, numbers[1:])) + (bool(numbers) and numbers[0] != 0)
            duplicates += sum(b <= a for a, b in zip(numbers, numbers[1:]))
            byte_identical += c.frames == canonical
            identical += text(c.frames) == text(undisturbed) and bool(text(undisturbed))
            for k in range(len(c.frames) - 1):  # each chunk it dropped after, by what it was
                dropped_after[kind(c.frames, k)] += 1
    return {"streams": len(clients), "byte_identical_to_a_whole_reading": byte_identical,
            "text_identical_to_undisturbed": identical, "gaps": gaps, "duplicates": duplicates,
            "drops": sum(dropped_after.values()), "dropped_after": dict(dropped_after),
            "streams_with_a_tool_call": sum(any(b'"tool_calls"' in f for f in c.frames) for c in clients)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=40)
    add_out_arg(ap, "resume-drops")
    args = ap.parse_args()
    report = Report("resume-drops", args.out)
    work = tempfile.mkdtemp(prefix="stagemesh-resume-drops-")
    dep = Deployment("up", args.stages, os.path.join(work, "state"), work, free_port())
    try:
        dep.start()

        async def undisturbed() -> list[list[bytes]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
                return await asyncio.gather(*(whole(s, dep.gw.url, body(i, args.max_tokens, False, f"u{i}"))
                                              for i in range(args.streams)))

        ref = asyncio.run(undisturbed())
        expected = sum(len(r) for r in ref)
        clients, timing = asyncio.run(drops(dep, args.streams, args.max_tokens, expected // 2))
        res = {"streams": args.streams, "stages": args.stages, "max_tokens": args.max_tokens,
               **timing, **asyncio.run(check(dep.gw.url, clients, ref)),
               "reconnects": sum(c.reconnects for c in clients), "retries": sum(c.retries for c in clients),
               "resume_statuses": dict(sum((c.statuses for c in clients), collections.Counter()))}
    finally:
        dep.stop()
    report.say(f"{res['streams']} resumable streams (tools, include_usage), each dropped after every chunk: "
               f"{res['drops']} drops ({', '.join(f'{k} {v}' for k, v in sorted(res['dropped_after'].items()))}); "
               f"{res['streams_with_a_tool_call']} streams with a tool call")
    report.say(f"`up` SIGKILLed after {res['chunks_before_kill']} chunks read in all, serving again in "
               f"{res['restart_s']} s; {res['retries']} reconnects refused or cut meanwhile, retried")
    report.say(f"byte-identical to a whole reading (ids included): {res['byte_identical_to_a_whole_reading']}/"
               f"{res['streams']}; text identical to the undisturbed run: {res['text_identical_to_undisturbed']}/"
               f"{res['streams']}; gaps {res['gaps']}, duplicates {res['duplicates']}")
    report.write(res)


if __name__ == "__main__":
    main()
