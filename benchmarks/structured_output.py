"""What constrained decoding costs: output tokens/s of the same chat requests with and without a JSON schema, on one
`stagemesh up`, at 1 and 16 concurrent streams.

    python -m benchmarks.structured_output [--out DIR] [--rounds 3] [--dtype D] [-- up flags]

Both kinds generate exactly --tokens tokens (free text with ignore_eos; the schema asks for at least 100 array items,
so the JSON is never complete before the cap), temperature 0.7, seeded, fresh prompts per round. Rounds alternate
the order (free, JSON, JSON, free, ...) so a drift of the shared machine's speed hits both alike; each round's own
ratio is kept. Writes structured.md and structured.json into --out (default: a new
benchmarks/results/<date>-structured)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

import aiohttp

from services.testing.harness import (
    add_dtype_arg,
    add_out_arg,
    dtype_label,
    results_dir,
    running_up,
    write_results,
)
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "facts": {"type": "array", "minItems": 100, "items": {"type": "object", "properties": {
        "fact": {"type": "string", "maxLength": 60}, "confidence": {"type": "number"}},
        "required": ["fact", "confidence"], "additionalProperties": False}}},
    "required": ["title", "facts"], "additionalProperties": False}
TOPICS = ["the sea", "volcanoes", "bees", "the moon", "bread", "trains", "glaciers", "owls", "copper", "tea"]


async def one(session: aiohttp.ClientSession, url: str, constrained: bool, seed: int, tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": f"Tell me facts about {random.Random(seed).choice(TOPICS)}."}],
            "max_tokens": tokens, "temperature": 0.7, "seed": seed}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        answer = await r.json()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {answer}")
    return answer["usage"]["completion_tokens"]


async def burst(url: str, constrained: bool, streams: int, seed: int, tokens: int) -> dict:
    """2 x streams requests, streams at a time: output tokens/s over the whole burst."""
    sem = asyncio.Semaphore(streams)

    async def limited(session, k):
        async with sem:
            return await one(session, url, constrained, seed + k, tokens)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(limited(session, k) for k in range(2 * streams)))
        wall = time.perf_counter() - t0
    return {"tokens": sum(done), "wall_s": wall, "tokens_per_s": sum(done) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arg(p, "structured")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", default="1,16", help="concurrency levels (default 1,16)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=1)
    add_dtype_arg(p)
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    levels = [int(x) for x in args.streams.split(",")]
    results: dict[int, dict[str, list[dict]]] = {n: {"free": [], "json": []} for n in levels}
    with running_up(args.stages, "--model", resolve_model(args.model), *args.extra, dtype=args.dtype) as gw:
        print(f"compiled decode: {gw.wait_compiled()}", flush=True)
        asyncio.run(burst(gw.url, True, 2, 1, 8))  # warm: the grammar compiles, llguidance reads the vocabulary
        for n in levels:
            for r in range(args.rounds):
                order = ("free", "json") if r % 2 == 0 else ("json", "free")
                for kind in order:
                    results[n][kind].append(asyncio.run(
                        burst(gw.url, kind == "json", n, 10_000 * n + 100 * r, args.tokens)))
                print(f"{n} stream(s), round {r + 1}: free {results[n]['free'][-1]['tokens_per_s']:.1f} tok/s, "
                      f"JSON {results[n]['json'][-1]['tokens_per_s']:.1f} tok/s", flush=True)
    rows = ["| streams | free text tok/s | JSON schema tok/s | JSON / free (each round) |", "| ---: | ---: | ---: | --- |"]
    for n in levels:
        free = [x["tokens_per_s"] for x in results[n]["free"]]
        js = [x["tokens_per_s"] for x in results[n]["json"]]
        ratios = ", ".join(f"{j / f:.2f}" for j, f in zip(js, free))
        rows.append(f"| {n} | {statistics.mean(free):.1f} | {statistics.mean(js):.1f} | "
                    f"**{statistics.mean(js) / statistics.mean(free):.2f}×** ({ratios}) |")
    model = resolve_model(args.model)
    header = (f"{GgufLoader(model).model_name} ({os.path.basename(model)}), {os.cpu_count()} CPU cores, stagemesh up "
              f"--stages {args.stages} {' '.join(args.extra)}, {dtype_label(args.dtype)}; {args.tokens} output tokens per request, 2 x streams "
              f"requests per burst, {args.rounds} rounds")
    md = header + "\n\n" + "\n".join(rows)
    print(md)
    write_results(results_dir(args.out, "structured"), "structured", {"settings": header, "results": results}, md)


if __name__ == "__main__":
    main()
