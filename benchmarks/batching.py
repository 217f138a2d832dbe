"""Continuous batching pays: aggregate generated tokens/s at 1, 4, 16 and 32 concurrent streams against
`stagemesh up --stages 2`, as ratios to the single-stream figure.

    python -m benchmarks.batching [--stages 2] [--dtype bfloat16] [--max-tokens 64] [--concurrency 1,4,16,32]

Every stream is a streamed /v1/completions with ignore_eos, so each request generates exactly --max-tokens."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import aiohttp

from loadtest.client import send_sse
from services.launch import start_up

PROMPTS = ["Write a story about a dragon.", "Explain how rain forms.", "List some fruits and describe them.",
           "Describe a busy city street.", "What is machine learning?", "Tell me about the history of Rome."]


async def one_stream(session, url: str, prompt: str, max_tokens: int) -> int:
    res = await send_sse(session, url, "openai", "smollm2", prompt, 0, max_tokens, ignore_eos=True, temperature=0.7)
    if not res.success:
        raise RuntimeError(res.error)
    return res.output_tokens


async def run_level(url: str, concurrency: int, max_tokens: int, rounds: int) -> float:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await one_stream(s, url, PROMPTS[0], 4)  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(s, url, PROMPTS[i % len(PROMPTS)], max_tokens)
                                        for i in range(concurrency * rounds)))
        return sum(counts) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16,32")
    args = p.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as logs:
        gw = start_up(args.stages, args.dtype, logs, "--kv-slots", str(max(levels)))
        try:
            gw.wait_compiled()  # measure steady state: --compile-decode auto compiles after /ready
            print(f"batching benchmark: stagemesh up --stages {args.stages} --dtype {args.dtype}, "
                  f"{args.max_tokens} tokens per request (ignore_eos)")
            base = None
            for c in levels:
                tps = asyncio.run(run_level(gw.url, c, args.max_tokens, rounds=1))
                base = base or tps
                print(f"  {c:>3} streams: {tps:8.1f} generated tokens/s  ({tps / base:5.2f}x single stream)")
        finally:
            gw.stop()


if __name__ == "__main__":
    main()
