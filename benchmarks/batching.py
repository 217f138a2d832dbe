"""Continuous batching pays: aggregate generated tokens/s at 1, 4, 16 and 32 concurrent streams against
`stagemesh up --stages 2`, as ratios to the single-stream figure, with each level's TTFT and inter-token latency.

    python -m benchmarks.batching [--stages 2] [--dtype D] [--max-tokens 64] [--concurrency 1,4,16,32] [--out DIR]

Every stream is a streamed /v1/completions with ignore_eos, so each request generates exactly --max-tokens. Writes
batching.json and batching.md into --out (default: a new benchmarks/results/<date>-batching)."""

from __future__ import annotations

import argparse
import asyncio

from services.testing.harness import (
    add_dtype_arg,
    add_out_arg,
    dtype_label,
    results_dir,
    run_level,
    running_up,
    write_results,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    add_dtype_arg(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16,32")
    add_out_arg(p, "batching")
    args = p.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    header = (f"batching benchmark: stagemesh up --stages {args.stages}, {dtype_label(args.dtype)}, "
              f"{args.max_tokens} tokens per request (ignore_eos)")
    rows = ["| streams | generated tokens/s | × single stream | TTFT p50 / p99 | ITL p50 / p99 |",
            "| ---: | ---: | ---: | ---: | ---: |"]
    results = []
    with running_up(args.stages, "--kv-slots", str(max(levels)), dtype=args.dtype) as gw:
        print(header)
        for c in levels:
            r = asyncio.run(run_level(gw.url, c, args.max_tokens))
            results.append(r)
            base = results[0].tokens_per_s
            print(f"  {c:>3} streams: {r.tokens_per_s:8.1f} generated tokens/s  ({r.tokens_per_s / base:5.2f}x single "
                  f"stream)  TTFT p50 {r.ttft_ms_p50:.0f} ms  ITL p50 {r.itl_ms_p50:.1f} ms", flush=True)
            rows.append(f"| {c} | {r.tokens_per_s:.1f} | {r.tokens_per_s / base:.2f}× | {r.ttft_ms_p50:.0f} / "
                        f"{r.ttft_ms_p99:.0f} ms | {r.itl_ms_p50:.1f} / {r.itl_ms_p99:.1f} ms |")
    out = results_dir(args.out, "batching")
    write_results(out, "batching", {"settings": header, "levels": [r.as_dict() for r in results]},
                  header + "\n\n" + "\n".join(rows))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
