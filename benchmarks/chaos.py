"""Chaos: 16 greedy streams run continuously against `stagemesh up` while a random stage is SIGKILLed every
--kill-every seconds for --duration seconds. `up` restarts a dead stage and the gateway replays what it was serving,
so every request must complete (the failure count is expected to be 0). Each text is also compared with its
undisturbed run. With --batch-invariant (passed to `up`) every text must equal it, so a mismatch is a failure;
without it a replayed greedy stream may legitimately differ in its tail (the batch it ran in changed), so mismatches
are only reported.

    python -m benchmarks.chaos [--stages 2] [--duration 180] [--kill-every 20] [--max-tokens 48] [--dtype float32]
        [--batch-invariant]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time

import aiohttp

from benchmarks.procs import children
from loadtest.client import send_sse
from services.launch import start_up

STREAMS = 16
PROMPTS = [f"Write a few sentences about topic number {i}: " + t for i, t in enumerate(
    ["rivers", "mountains", "bread", "trains", "owls", "chess", "rain", "copper", "tea", "maps", "bells", "salt",
     "kites", "glass", "moss", "clocks"])]


async def one(session, url: str, i: int, max_tokens: int):
    return await send_sse(session, url, "openai", "smollm2", PROMPTS[i], 0, max_tokens, ignore_eos=True,
                          temperature=0.0)


async def reference(url: str, max_tokens: int) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        results = await asyncio.gather(*(one(s, url, i, max_tokens) for i in range(STREAMS)))
    bad = [r.error for r in results if not r.success]
    if bad:
        raise SystemExit(f"the undisturbed run failed: {bad[0]}")
    return [r.text for r in results]


async def chaos(url: str, up_pid: int, ref: list[str], duration: float, kill_every: float, max_tokens: int) -> dict:
    stats = {"completed": 0, "failed": 0, "differs": 0, "kills": 0, "errors": []}
    end = time.monotonic() + duration

    async def stream_loop(s, i: int) -> None:
        while time.monotonic() < end:
            r = await one(s, url, i, max_tokens)
            if not r.success:
                stats["failed"] += 1
                stats["errors"].append(r.error[:200])
                continue
            stats["completed"] += 1
            stats["differs"] += r.text != ref[i]

    async def killer() -> None:
        rng = random.Random(0)
        while time.monotonic() + kill_every < end:
            await asyncio.sleep(kill_every)
            stages = children(up_pid)
            if stages:
                victim = rng.choice(stages)
                os.kill(victim, signal.SIGKILL)
                stats["kills"] += 1
                print(f"  t={duration - (end - time.monotonic()):.0f}s: SIGKILL stage pid {victim}", flush=True)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        await asyncio.gather(killer(), *(stream_loop(s, i) for i in range(STREAMS)))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of chaos (default 180)")
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between SIGKILLs (default 20)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="run the stages batch-invariant: every text must then equal its undisturbed run")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    extra = ["--batch-invariant"] if args.batch_invariant else []
    gw = start_up(args.stages, args.dtype, tempfile.mkdtemp(prefix="stagemesh-chaos-"), *extra)
    try:
        gw.wait_compiled()  # measure steady state: --compile-decode auto compiles after /ready
        ref = asyncio.run(reference(gw.url, args.max_tokens))
        print(f"undisturbed run done; chaos for {args.duration:.0f} s, a SIGKILL every {args.kill_every:.0f} s",
              flush=True)
        stats = asyncio.run(chaos(gw.url, gw.proc.pid, ref, args.duration, args.kill_every, args.max_tokens))
    finally:
        gw.stop()
    stats["errors"] = stats["errors"][:5]
    stats["batch_invariant"] = args.batch_invariant
    if args.json:
        print(json.dumps(stats))
    else:
        expectation = "expected 0" if args.batch_invariant else "allowed without --batch-invariant"
        print(f"{stats['kills']} stage kills, {stats['completed']} requests completed, {stats['failed']} failed "
              f"(expected 0); {stats['differs']} completed texts differ from their undisturbed run ({expectation})")
        for e in stats["errors"]:
            print("  error:", e)
    if stats["failed"] or (args.batch_invariant and stats["differs"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
