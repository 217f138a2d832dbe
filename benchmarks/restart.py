"""Streams that survive (issue 57), on one mesh of --stages stages under --batch-invariant, each phase against the texts
of --streams seeded streams run undisturbed first:

- disconnects: every client drops its connection twice at random points, the second time right after a resume,
  before reading any event (the case where a client that keeps no cursor loses its place), and resumes by its
  Last-Event-ID;
- a gateway SIGKILL mid-stream (--kill gateway: the gateway process alone, the stages live on and keep the K/V;
  --kill up: `stagemesh up`, its stages die with it), restarted on the same state directory and port; every client
  reconnects with its Last-Event-ID;
- the request log's cost: output tokens/s of resumable (logged) streams against the same streams not logged,
  alternated --rounds times on the restarted gateway.

Reports texts identical to the undisturbed run (expected all), streams with a gap or a duplicate event (expected
none), and for the restart the time from the new gateway's readiness to each stream's first resumed event.

    python -m benchmarks.restart [--streams 32] [--stages 2] [--max-tokens 48] [--kill gateway|up|both]
                                 [--rounds 2] [--out DIR]"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

import aiohttp

from services.testing.harness import Report, add_out_arg, free_port
from services.testing.resumable import (
    Deployment,
    Events,
    body,
    compare,
    read_sse,
    resume,
    stream,
    undisturbed,
)


async def disconnects(url: str, ref: list[Events], max_tokens: int, rng: random.Random) -> dict:
    """Each client reads a random number of events, drops the connection, resumes and drops again before reading
    any event, then resumes and reads to the end."""
    n = len(ref)
    runs: list[Events] = [[] for _ in range(n)]
    statuses: list[list[int]] = [[] for _ in range(n)]

    async def client(i: int, s) -> None:
        async with s.post(url + "/v1/chat/completions", json=body(i, max_tokens, True, f"d-{i}")) as r:
            await read_sse(r, runs[i], limit=rng.randint(2, max_tokens // 2))  # then the connection is dropped
        rid = runs[i][0][1]["id"]
        await asyncio.sleep(rng.uniform(0, 0.5))
        statuses[i].append(await resume(s, url, rid, runs[i], limit=0))  # dropped before its first event
        await asyncio.sleep(rng.uniform(0, 0.5))
        statuses[i].append(await resume(s, url, rid, runs[i]))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        await asyncio.gather(*(client(i, s) for i in range(n)))
    return {**compare(runs, ref), "resume_statuses": sorted({st for sts in statuses for st in sts})}


async def kill_and_resume(dep: Deployment, ref: list[Events], max_tokens: int) -> dict:
    n = len(ref)
    seen: list[Events] = [[] for _ in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        tasks = [asyncio.create_task(stream(s, dep.gw.url, body(i, max_tokens, True, f"r-{i}"), seen[i]))
                 for i in range(n)]
        while sum(len(e) for e in seen) < n * max_tokens // 3:  # a third of the way in
            await asyncio.sleep(0.05)
        dep.kill()
        await asyncio.gather(*tasks)
    cut = [len(e) for e in seen]
    gw = dep.start()
    ready = time.monotonic()
    firsts: list[float | None] = [None] * n
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        async def again(i: int) -> None:
            first: list[float] = []
            statuses.append(await resume(s, gw.url, seen[i][0][1]["id"], seen[i], first=first))
            firsts[i] = first[0] - ready if first else None
        await asyncio.gather(*(again(i) for i in range(n)))
    waits = [w for w in firsts if w is not None]
    return {"kill": dep.kill_what, **compare(seen, ref), "resume_statuses": sorted(set(statuses)),
            "events_before_kill": {"min": min(cut), "max": max(cut)},
            "first_resumed_event_s": {"p50": round(statistics.median(waits), 3) if waits else None,
                                      "max": round(max(waits), 3) if waits else None, "resumed": len(waits)}}


async def tokens_per_s(url: str, streams: int, max_tokens: int, resumable: bool, salt: str) -> float:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.monotonic()
        runs: list[Events] = [[] for _ in range(streams)]
        await asyncio.gather(*(stream(s, url, body(i, max_tokens, resumable, f"{salt}-{i}"), runs[i])
                               for i in range(streams)))
        return streams * max_tokens / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kill", choices=["gateway", "up", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="where the clients drop their connections")
    add_out_arg(ap, "restart")
    args = ap.parse_args()
    report = Report("restart", args.out)
    res: dict = {"streams": args.streams, "stages": args.stages, "max_tokens": args.max_tokens}
    for kill_what in (["gateway", "up"] if args.kill == "both" else [args.kill]):
        work = tempfile.mkdtemp(prefix=f"stagemesh-restart-{kill_what}-")
        dep = Deployment(kill_what, args.stages, os.path.join(work, "state"), work, free_port())
        try:
            dep.start()
            ref = asyncio.run(undisturbed(dep.gw.url, args.streams, args.max_tokens))
            if "disconnects" not in res:
                d = res["disconnects"] = asyncio.run(disconnects(dep.gw.url, ref, args.max_tokens,
                                                                 random.Random(args.seed)))
                report.say(f"disconnects: {d['streams']} seeded resumable streams, each dropped twice (once right "
                           f"after a resume): {d['identical']}/{d['streams']} with the undisturbed text, "
                           f"{d['gaps_or_duplicates']} with a gap or duplicate; resumes answered {d['resume_statuses']}")
            k = res[f"kill_{kill_what}"] = asyncio.run(kill_and_resume(dep, ref, args.max_tokens))
            what = "the gateway alone" if kill_what == "gateway" else "up (its stages die with it)"
            report.say(f"{k['streams']} seeded resumable streams, {what} SIGKILLed after {k['events_before_kill']} "
                       f"events each, restarted on its state directory: {k['identical']}/{k['streams']} with the "
                       f"undisturbed text, {k['gaps_or_duplicates']} with a gap or duplicate; first resumed event "
                       f"{k['first_resumed_event_s']['p50']} s after readiness (p50), "
                       f"{k['first_resumed_event_s']['max']} s (max)")
            if kill_what == "gateway" or args.kill == "up":
                logged, plain = [], []
                for r in range(args.rounds):  # alternated: the machine's drift falls on both
                    plain.append(asyncio.run(tokens_per_s(dep.gw.url, args.streams, args.max_tokens, False, f"p{r}")))
                    logged.append(asyncio.run(tokens_per_s(dep.gw.url, args.streams, args.max_tokens, True, f"l{r}")))
                res["cost"] = {"logged_tok_s": [round(x, 1) for x in logged],
                               "unlogged_tok_s": [round(x, 1) for x in plain],
                               "ratio": round(statistics.median(logged) / statistics.median(plain), 3)}
                report.say(f"the request log's cost at {args.streams} streams: {statistics.median(logged):.1f} tok/s "
                           f"logged against {statistics.median(plain):.1f} not ({res['cost']['ratio']:.3f}x; rounds "
                           f"{res['cost']['logged_tok_s']} / {res['cost']['unlogged_tok_s']})")
        finally:
            dep.stop()
    report.write(res)


if __name__ == "__main__":
    main()
