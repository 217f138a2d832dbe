"""A gateway restart under load (issue 57): --streams seeded resumable streams run against `stagemesh up
--batch-invariant --state-dir D`; `up` is SIGKILLed mid-stream (its stages die with it) and started again on the same
state directory and port; every client reconnects with its Last-Event-ID and reads on. Reports how many streams
finished with the text of an undisturbed run (expected all), gaps or duplicates (expected none), and the time from
the new gateway's readiness to each stream's first resumed event (p50, max).

Then the request log's cost: output tokens/s of --streams resumable streams (logged) against the same streams not
marked resumable (not logged), alternated --rounds times on one gateway.

    python -m benchmarks.restart [--streams 32] [--stages 2] [--max-tokens 48] [--rounds 2] [--out DIR]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time

import aiohttp

from services.testing.harness import Report, add_out_arg, free_port, start_up

PROMPT = "Tell me a story about the number {i}."


def body(i: int, max_tokens: int, resumable: bool, salt: str) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT.format(i=i)}], "max_tokens": max_tokens, "seed": 1000 + i,
            "temperature": 0.9, "ignore_eos": True, "stream": True, "resumable": resumable, "cache_salt": salt}


async def read_sse(resp, events: list, first: list | None = None) -> None:
    """Append (event id, data) to `events` as they come, until [DONE] or the connection ends; `first` gets the
    time.monotonic() of the first one."""
    current = None
    async for raw in resp.content:
        if first is not None and not first and raw.startswith(b"data: "):
            first.append(time.monotonic())
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            current = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((current, data if data == "[DONE]" else json.loads(data)))
            current = None
            if data == "[DONE]":
                return


def text(events) -> str:
    return "".join(d["choices"][0]["delta"].get("content") or "" for _, d in events
                   if isinstance(d, dict) and d.get("choices"))


async def stream(s, url: str, b: dict, events: list) -> None:
    try:
        async with s.post(url + "/v1/chat/completions", json=b) as r:
            await read_sse(r, events)
    except (TimeoutError, aiohttp.ClientError):
        pass  # the gateway died under it: the client keeps what it read


async def tokens_per_s(url: str, streams: int, max_tokens: int, resumable: bool, salt: str) -> float:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.monotonic()
        runs = [[] for _ in range(streams)]
        await asyncio.gather(*(stream(s, url, body(i, max_tokens, resumable, f"{salt}-{i}"), runs[i])
                               for i in range(streams)))
        return streams * max_tokens / (time.monotonic() - t0)


async def kill_and_resume(args, state: str, port: int, logs: str) -> dict:
    for run in ("first", "second"):
        os.makedirs(os.path.join(logs, run), exist_ok=True)
    gw = start_up(args.stages, None, os.path.join(logs, "first"), "--batch-invariant", "--state-dir", state,
                  port=port)
    seen = [[] for _ in range(args.streams)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        tasks = [asyncio.create_task(stream(s, gw.url, body(i, args.max_tokens, True, f"r-{i}"), seen[i]))
                 for i in range(args.streams)]
        while sum(len(e) for e in seen) < args.streams * args.max_tokens // 3:  # a third of the way in
            await asyncio.sleep(0.05)
        os.kill(gw.proc.pid, signal.SIGKILL)
        gw.proc.wait(30)
        await asyncio.gather(*tasks)
    cut = [len(e) for e in seen]
    again = start_up(args.stages, None, os.path.join(logs, "second"), "--batch-invariant", "--state-dir", state,
                     port=port)
    ready = time.monotonic()
    try:
        firsts, rest = [None] * args.streams, [[] for _ in range(args.streams)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            async def resume(i: int) -> None:
                rid = seen[i][0][1]["id"]
                last = next((eid for eid, _ in reversed(seen[i]) if eid), None)
                async with s.get(f"{again.url}/v1/streams/{rid}", headers={"Last-Event-ID": last} if last else {}) as r:
                    if r.status != 200:
                        rest[i].append((None, {"error": await r.text()}))
                        return
                    first: list[float] = []
                    await read_sse(r, rest[i], first)
                    firsts[i] = first[0] - ready if first else None
            await asyncio.gather(*(resume(i) for i in range(args.streams)))
            ref = [[] for _ in range(args.streams)]
            await asyncio.gather(*(stream(s, again.url, body(i, args.max_tokens, False, f"u-{i}"), ref[i])
                                   for i in range(args.streams)))
        identical = sum(text(seen[i] + rest[i]) == text(ref[i]) and bool(text(ref[i])) for i in range(args.streams))
        gaps = 0
        for i in range(args.streams):
            offsets = [int(eid.split(":")[1]) for eid, _ in seen[i] + rest[i] if eid]
            if offsets != sorted(offsets) or (rest[i] and seen[i] and offsets[len(seen[i])] != offsets[len(seen[i]) - 1] + 1):
                gaps += 1
        waits = [w for w in firsts if w is not None]
        return {"streams": args.streams, "identical": identical, "gaps_or_duplicates": gaps,
                "events_before_kill": {"min": min(cut), "max": max(cut)},
                "first_resumed_event_s": {"p50": round(statistics.median(waits), 3) if waits else None,
                                          "max": round(max(waits), 3) if waits else None, "resumed": len(waits)},
                "gateway": again}
    except BaseException:
        again.stop()
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    add_out_arg(ap, "restart")
    args = ap.parse_args()
    report = Report("restart", args.out)
    work = tempfile.mkdtemp(prefix="stagemesh-restart-")
    state, port = os.path.join(work, "state"), free_port()
    res = asyncio.run(kill_and_resume(args, state, port, work))
    gw = res.pop("gateway")
    try:
        report.say(f"{res['streams']} seeded resumable streams, up SIGKILLed after {res['events_before_kill']} events "
                   f"each, restarted on its state directory: {res['identical']}/{res['streams']} finished with the "
                   f"undisturbed text, {res['gaps_or_duplicates']} with a gap or duplicate; first resumed event "
                   f"{res['first_resumed_event_s']['p50']} s after readiness (p50), "
                   f"{res['first_resumed_event_s']['max']} s (max)")
        logged, plain = [], []
        for r in range(args.rounds):  # alternated: the machine's drift falls on both
            plain.append(asyncio.run(tokens_per_s(gw.url, args.streams, args.max_tokens, False, f"p{r}")))
            logged.append(asyncio.run(tokens_per_s(gw.url, args.streams, args.max_tokens, True, f"l{r}")))
        res["cost"] = {"logged_tok_s": [round(x, 1) for x in logged], "unlogged_tok_s": [round(x, 1) for x in plain],
                       "ratio": round(statistics.median(logged) / statistics.median(plain), 3)}
        report.say(f"the request log's cost at {args.streams} streams: {statistics.median(logged):.1f} tok/s logged "
                   f"against {statistics.median(plain):.1f} not ({res['cost']['ratio']:.3f}x; rounds {logged} / {plain})")
    finally:
        gw.stop()
    report.write(res)


if __name__ == "__main__":
    main()
