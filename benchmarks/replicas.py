"""Aggregate throughput of R pipelines against one, on the same load: `stagemesh up --replicas R --stages S` against
`stagemesh up --stages S`, same model, same machine, the same requests to both.

    python -m benchmarks.replicas [--replicas 2] [--stages 1] [--concurrency 16] [--max-tokens 64] [--rounds 2]
        [--dtype D] [--out DIR] [-- up flags]

Each round sends --concurrency distinct streams at once (greedy, ignore_eos, so every request generates exactly
--max-tokens) to each setup in turn (the order reversed every other round) and measures output tokens per second of
the whole burst, and time to first token. Prints a table with the ratio (R pipelines / 1) and writes replicas.json and
replicas.md into --out (default: a new benchmarks/results/<date>-replicas).

Read the ratio against the cores: `up` gives each stage process cpu_count / (stages x replicas) threads, so on a
machine with fewer cores than stage processes x their threads' worth of work the replicas share the same cores and
the ratio stays near 1 (or below: two processes of one thread decode two half batches where one of two threads did a
whole one). Replicas pay off when each pipeline has cores of its own (other hosts: `stagemesh gateway --pipeline`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import aiohttp

from loadtest.client import send_sse
from services.testing.harness import (
    add_dtype_arg,
    add_out_arg,
    dtype_label,
    results_dir,
    running_up,
    write_results,
)


async def burst(url: str, concurrency: int, max_tokens: int, seed: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            send_sse(s, url, "openai", "smollm2", f"Story {seed}-{i}: tell me about the {i}th lighthouse keeper.", 0,
                     max_tokens, ignore_eos=True) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    errors = [r.error for r in results if not r.success]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, the first: {errors[0]}")
    tokens = sum(r.output_tokens for r in results)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "ttft_ms_median": round(1e3 * statistics.median(r.ttft for r in results), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="pipelines of the replicated setup (default 2)")
    p.add_argument("--stages", type=int, default=1, help="stages per pipeline, both setups (default 1)")
    p.add_argument("--concurrency", type=int, default=16, help="streams at once (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the setups in turn in each (default 2)")
    add_dtype_arg(p)
    add_out_arg(p, "replicas")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    setups = {"1 pipeline": [], f"{args.replicas} pipelines": ["--replicas", str(args.replicas)]}
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    for rnd in range(args.rounds):
        order = list(setups) if rnd % 2 == 0 else list(reversed(setups))
        for name in order:
            with running_up(args.stages, *setups[name], *args.extra, dtype=args.dtype) as gw:
                asyncio.run(burst(gw.url, 2, 4, seed=-1))  # warm-up: first-call costs out of the measurement
                runs[name].append(asyncio.run(burst(gw.url, args.concurrency, args.max_tokens, seed=rnd)))
            print(f"round {rnd + 1} {name}: {runs[name][-1]}", flush=True)
    one, many = (statistics.median(r["tokens_per_s"] for r in runs[n]) for n in setups)
    result = {"cpu_count": os.cpu_count(), "dtype": dtype_label(args.dtype), "args": vars(args), "runs": runs,
              "ratio_tokens_per_s": round(many / one, 3)}
    rows = [f"| setup | output tokens/s (median of {args.rounds}) | TTFT median (ms) |", "|---|---|---|"]
    for name in setups:
        ttft = statistics.median(r["ttft_ms_median"] for r in runs[name])
        rows.append(f"| {name} x {args.stages} stage(s) | "
                    f"{statistics.median(r['tokens_per_s'] for r in runs[name]):.1f} | {ttft:.0f} |")
    ratio = (f"ratio {args.replicas} pipelines / 1: {many / one:.2f} on {os.cpu_count()} cores, "
             f"{dtype_label(args.dtype)} (bounded by the cores every stage process shares; see the module docstring)")
    md = "\n".join(rows) + "\n\n" + ratio
    print("\n" + md)
    write_results(results_dir(args.out, "replicas"), "replicas", result, md)


if __name__ == "__main__":
    sys.exit(main())
