"""What watching the mesh costs: aggregate generated tokens/s of `stagemesh up --stages 2` with no client on the
mesh view's stream, and with --subscribers clients each reading `GET /v1/mesh/stream` (the chat page's #mesh view),
alternated over --rounds rounds so drift on a shared machine hits both equally.

    python -m benchmarks.mesh_view_overhead [--concurrency 16] [--max-tokens 64] [--subscribers 4] [--rounds 3]
        [--dtype D] [--out DIR]

Writes mesh_view_overhead.json and mesh_view_overhead.md (what it printed) into --out (default: a new
benchmarks/results/<date>-mesh_view_overhead)."""

from __future__ import annotations

import argparse
import asyncio
import statistics

import aiohttp

from services.testing.harness import Report, add_dtype_arg, add_out_arg, dtype_label, run_level, running_up


async def with_subscribers(url: str, n: int, concurrency: int, max_tokens: int) -> tuple[float, int]:
    """tokens/s of one load level while n clients read the mesh stream; also how many snapshots they received."""
    received = [0] * n

    async def subscribe(i: int) -> None:
        async with aiohttp.ClientSession() as s, s.get(url + "/v1/mesh/stream") as r:
            async for line in r.content:
                if line.startswith(b"data: "):
                    received[i] += 1

    subs = [asyncio.create_task(subscribe(i)) for i in range(n)]
    try:
        await asyncio.sleep(0.5)
        tps = (await run_level(url, concurrency, max_tokens)).tokens_per_s
    finally:
        for t in subs:
            t.cancel()
        await asyncio.gather(*subs, return_exceptions=True)
    return tps, sum(received)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    add_dtype_arg(p)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--subscribers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    add_out_arg(p, "mesh_view_overhead")
    args = p.parse_args()
    report = Report("mesh_view_overhead", args.out)
    with running_up(args.stages, "--kv-slots", str(max(16, args.concurrency)), dtype=args.dtype) as gw:
        off, on, snapshots = [], [], 0
        for r in range(args.rounds):
            off.append(asyncio.run(with_subscribers(gw.url, 0, args.concurrency, args.max_tokens))[0])
            tps, n = asyncio.run(with_subscribers(gw.url, args.subscribers, args.concurrency, args.max_tokens))
            on.append(tps)
            snapshots += n
            report.say(f"  round {r + 1}: no subscriber {off[-1]:7.1f} tok/s   {args.subscribers} subscribers "
                       f"{on[-1]:7.1f} tok/s")
        m_off, m_on = statistics.mean(off), statistics.mean(on)
        noise = statistics.stdev(off) / m_off if len(off) > 1 else float("nan")
        report.say(f"mesh view overhead: {dtype_label(args.dtype)}, {args.concurrency} streams x {args.max_tokens} tokens, {args.rounds} rounds: "
                   f"without {m_off:.1f} tok/s, with {args.subscribers} subscribers {m_on:.1f} tok/s "
                   f"(ratio {m_on / m_off:.3f}; run-to-run spread without subscribers {100 * noise:.1f}%; "
                   f"{snapshots} snapshots delivered)")
    report.write({"settings": vars(args) | {"dtype": dtype_label(args.dtype)}, "tokens_per_s_without": off,
                  "tokens_per_s_with": on, "snapshots": snapshots})


if __name__ == "__main__":
    main()
