"""Soak: --minutes at about 70 % of measured capacity with 30 % of clients aborting mid-stream, against
`stagemesh up`. Reports the RSS slope (MB/min) of the gateway and of each stage, the KV slots still held at the end
(expected 0 on every stage), and the failed requests (expected 0; an abort by the client is not a failure).

    python -m benchmarks.soak [--minutes 10] [--stages 2] [--load 0.7] [--abort 0.3] [--max-tokens 32]
        [--streams N] [--dtype D] [--json] [--out DIR]

--streams N: N closed-loop clients of mixed traffic instead of open-loop arrivals, the prefix cache's workload --
multi-turn chats (each turn sends the whole history), questions after one shared ~600-token system prompt, and
distinct ~300-token prompts, a third each -- with --abort of them closing mid-stream. Also reports the prefix cache's
hits and the stages' cached-prefix rows at the end.

Writes soak.json and soak.md (what it printed) into --out (default: a new benchmarks/results/<date>-soak)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time

import aiohttp

from loadtest.client import StreamEndedEarly, sse_events
from services.testing.harness import (
    Report,
    add_dtype_arg,
    add_out_arg,
    children,
    dtype_label,
    rss_mb,
    running_up,
    slope_per_min,
)

PROMPTS = ["Write a story about a dragon.", "Explain how rain forms.", "List some fruits.", "Describe a city street.",
           "What is machine learning?", "Tell me about Rome.", "How do bees make honey?", "Why is the sky blue?"]


async def request(s, url: str, prompt: str, max_tokens: int, abort_after: int | None) -> str:
    """"ok", "aborted" or an error text. abort_after: close the connection after that many chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "stream": True, "ignore_eos": True}
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return f"HTTP {r.status}: {(await r.text())[:200]}"
            n = 0
            async for chunk in sse_events(r):
                if "error" in chunk:
                    return f"error event: {chunk['error']['message'][:200]}"
                n += 1
                if abort_after is not None and n >= abort_after:
                    r.close()  # the client goes away mid-stream
                    return "aborted"
            return "ok"
    except (TimeoutError, aiohttp.ClientError, StreamEndedEarly) as e:
        return f"{type(e).__name__}: {e}"


SHARED_SYSTEM = ("You are the help desk of a harbour town's library. " + " ".join(
    f"Rule {i}: answer about the library's {topic} politely, briefly and only from what the patron says."
    for i, topic in enumerate(["opening hours", "loans", "fines", "rooms", "printers", "events", "archives",
                               "maps", "children's corner", "lost items", "donations", "volunteers"] * 2)))
WORDS = ("harbour lantern copper meadow violet engine thunder pebble quiet orchard silver canyon ribbon falcon "
         "marble winter saddle garden comet velvet anchor thistle beacon prairie").split()


async def chat_request(s, url: str, messages: list[dict], max_tokens: int, abort_after: int | None) -> tuple[str, str]:
    """(outcome as request()'s, the answer's text) of one streamed chat completion."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.7, "stream": True}
    text = []
    try:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return f"HTTP {r.status}: {(await r.text())[:200]}", ""
            n = 0
            async for chunk in sse_events(r):
                if "error" in chunk:
                    return f"error event: {chunk['error']['message'][:200]}", ""
                if chunk.get("choices"):
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
                n += 1
                if abort_after is not None and n >= abort_after:
                    r.close()
                    return "aborted", ""
            return "ok", "".join(text)
    except (TimeoutError, aiohttp.ClientError, StreamEndedEarly) as e:
        return f"{type(e).__name__}: {e}", ""


async def mixed(url: str, up_pid: int, streams: int, minutes: float, abort: float, max_tokens: int) -> dict:
    """`streams` closed-loop clients, each in turn a multi-turn chat (up to 6 turns, then a new one), a question
    after the shared system prompt, or a distinct prompt; `abort` of the requests cut mid-stream."""
    rng = random.Random(0)
    outcomes: dict[str, int] = {"ok": 0, "aborted": 0, "failed": 0}
    kinds: dict[str, int] = {"chat": 0, "shared": 0, "distinct": 0}
    errors: list[str] = []
    pids = {"gateway": up_pid, **{f"stage{i}": p for i, p in enumerate(children(up_pid))}}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in pids}
    t0 = time.monotonic()
    end = t0 + 60 * minutes

    def count(out: str) -> None:
        key = out if out in ("ok", "aborted") else "failed"
        outcomes[key] += 1
        if key == "failed":
            errors.append(out)

    async def client(i: int, s) -> None:
        history: list[dict] = []
        while time.monotonic() < end:
            cut = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < abort else None
            kind = ("chat", "shared", "distinct")[(i + kinds["chat"] + kinds["shared"] + kinds["distinct"]) % 3]
            kinds[kind] += 1
            if kind == "chat":
                if len(history) >= 12:
                    history = []
                history.append({"role": "user", "content": f"Tell me about the {rng.choice(WORDS)} "
                                                           f"{rng.choice(WORDS)} (client {i})."})
                out, answer = await chat_request(s, url, history, max_tokens, cut)
                if out == "ok":
                    history.append({"role": "assistant", "content": answer})
                else:
                    history.pop()
            elif kind == "shared":
                out, _ = await chat_request(s, url, [{"role": "system", "content": SHARED_SYSTEM}, {
                    "role": "user", "content": f"Can I borrow a {rng.choice(WORDS)} book on {rng.choice(WORDS)}s?"}],
                                            max_tokens, cut)
            else:
                prompt = " ".join(rng.choice(WORDS) for _ in range(120))
                out = await request(s, url, prompt, max_tokens, cut)
            count(out)

    async def sampler() -> None:
        while time.monotonic() < end:
            for k, p in pids.items():
                samples[k].append((time.monotonic() - t0, rss_mb(p)))
            await asyncio.sleep(5)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(sampler(), *(client(i, s) for i in range(streams)))
    warm = 0.2 * 60 * minutes
    slopes = {k: round(slope_per_min([x for x in v if x[0] >= warm]), 2) for k, v in samples.items()}
    rss = {k: round(v[-1][1], 1) for k, v in samples.items() if v}
    return {"outcomes": outcomes, "kinds": kinds, "errors": errors[:5], "rss_slope_mb_per_min": slopes,
            "rss_mb_end": rss, "rss_mb_after_warmup": {k: round(next((x[1] for x in v if x[0] >= warm), 0), 1)
                                                       for k, v in samples.items()}}


async def capacity(url: str, max_tokens: int, concurrency: int = 16, seconds: float = 30.0) -> float:
    """Completed requests per second with `concurrency` closed-loop clients."""
    done = 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:
        async def loop(i):
            nonlocal done
            while time.monotonic() < end:
                if await request(s, url, PROMPTS[i % len(PROMPTS)], max_tokens, None) == "ok":
                    done += 1
        t0 = time.monotonic()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        return done / (time.monotonic() - t0)


async def soak(url: str, up_pid: int, rate: float, minutes: float, abort: float, max_tokens: int) -> dict:
    rng = random.Random(0)
    outcomes: dict[str, int] = {"ok": 0, "aborted": 0, "failed": 0}
    errors: list[str] = []
    pids = {"gateway": up_pid, **{f"stage{i}": p for i, p in enumerate(children(up_pid))}}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in pids}
    t0 = time.monotonic()
    end = t0 + 60 * minutes

    async def one(s) -> None:
        cut = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < abort else None
        out = await request(s, url, rng.choice(PROMPTS), max_tokens, cut)
        key = out if out in ("ok", "aborted") else "failed"
        outcomes[key] += 1
        if key == "failed":
            errors.append(out)

    async def sampler() -> None:
        while time.monotonic() < end:
            for k, p in pids.items():
                samples[k].append((time.monotonic() - t0, rss_mb(p)))
            await asyncio.sleep(5)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        tasks = [asyncio.create_task(sampler())]
        while time.monotonic() < end:  # open loop: Poisson arrivals at `rate`
            tasks.append(asyncio.create_task(one(s)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    warm = 0.2 * 60 * minutes  # the first fifth is warm-up (allocator pools, caches)
    slopes = {k: round(slope_per_min([x for x in v if x[0] >= warm]), 2) for k, v in samples.items()}
    rss = {k: round(v[-1][1], 1) for k, v in samples.items() if v}
    return {"outcomes": outcomes, "errors": errors[:5], "rss_slope_mb_per_min": slopes, "rss_mb_end": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of measured capacity (default 0.7)")
    ap.add_argument("--abort", type=float, default=0.3, help="fraction of clients that abort mid-stream")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, default=0, help="closed-loop clients of mixed chat / shared-prompt / "
                                                          "distinct traffic (0: open-loop arrivals at --load)")
    add_dtype_arg(ap)
    ap.add_argument("--json", action="store_true")
    add_out_arg(ap, "soak")
    args = ap.parse_args()
    report = Report("soak", args.out)
    logs = tempfile.mkdtemp(prefix="stagemesh-soak-")  # kept: the logs of a soak that failed are the evidence
    with running_up(args.stages, "--kv-slots", "32", dtype=args.dtype, log_dir=logs) as gw:
        if args.streams:
            cap = rate = 0.0
            report.say(f"{dtype_label(args.dtype)}: soaking {args.minutes:g} min with {args.streams} clients of mixed "
                       f"traffic, {args.abort:.0%} aborts (logs in {logs})")
            res = asyncio.run(mixed(gw.url, gw.proc.pid, args.streams, args.minutes, args.abort, args.max_tokens))
        else:
            cap = asyncio.run(capacity(gw.url, args.max_tokens))
            rate = args.load * cap
            report.say(f"{dtype_label(args.dtype)}: capacity {cap:.2f} req/s; soaking {args.minutes:g} min at "
                       f"{rate:.2f} req/s, {args.abort:.0%} aborts (logs in {logs})")
            res = asyncio.run(soak(gw.url, gw.proc.pid, rate, args.minutes, args.abort, args.max_tokens))
        time.sleep(2.0)  # releases of the last aborts reach the stages
        res["kv_used_slots_end"] = [gw.stage_info(i).kv_slots_used for i in range(args.stages)]
        res["gateway_running_end"] = gw.metric("stagemesh_gateway_running_sequences")
        res["prefix_cache_hits"] = gw.metric("stagemesh_gateway_prefix_cache_hits_total")
        res["kv_cached_prefix_rows_end"] = [gw.stage_info(i).kv_slots_cached for i in range(args.stages)]
        res["capacity_req_s"], res["rate_req_s"] = round(cap, 2), round(rate, 2)
        res["dtype"] = dtype_label(args.dtype)
    if args.json:
        print(json.dumps(res))
    else:
        o = res["outcomes"]
        report.say(f"{o['ok']} completed, {o['aborted']} aborted by the client, {o['failed']} failed (expected 0)")
        report.say(f"RSS slope MB/min: {res['rss_slope_mb_per_min']}; RSS at the end MB: {res['rss_mb_end']}")
        if "kinds" in res:
            report.say(f"requests by kind: {res['kinds']}; RSS after warm-up MB: {res['rss_mb_after_warmup']}; prefix "
                       f"cache hits {res['prefix_cache_hits']:.0f}, cached-prefix rows at the end "
                       f"{res['kv_cached_prefix_rows_end']}")
        report.say(f"KV slots used at the end: {res['kv_used_slots_end']} (expected all 0); gateway running sequences: "
                   f"{res['gateway_running_end']:.0f}")
        for e in res["errors"]:
            report.say(f"  error: {e}")
    report.write(res)


if __name__ == "__main__":
    main()
