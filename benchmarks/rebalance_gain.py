"""Is `stagemesh rebalance --dry-run`'s predicted gain the gain a re-split delivers? (issue 58: within 15 %)

A 2-stage `stagemesh up --split S` under --streams streams: lopsided on purpose on a shared machine, or (--quotas
1,0.5) uneven hosts -- each stage pinned to a core of its own and throttled to that share of it from its start
(cgroup v1), as benchmarks/split_auto.py does. With the load running: measure the throughput at split S,
ask `rebalance --dry-run --json` for its proposal P and predicted gain, re-split live to P, measure, re-split back to
S, measure, and so on --rounds times (S and P alternate, so a drift in the machine's speed lands on both). The
measured gain is the median over rounds of P's throughput over the S runs' beside it.

    python -m benchmarks.rebalance_gain [--split 24] [--streams 16] [--measure 15] [--rounds 2]
                                        [--quotas 1,0.5] [--out DIR]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time

from services.testing.harness import Load, Report, add_out_arg, running_up
from services.testing.slow_host import start_pinned


def rebalance(url: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "services.cli", "rebalance", url, *args, "--json"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"rebalance {' '.join(args)} failed: {done.stderr}")
    return json.loads(done.stdout)


async def run(url: str, args, report: Report) -> dict:
    load = Load(url, args.streams, args.max_tokens)
    runner = asyncio.create_task(load.run())

    async def rate(split: str) -> float:
        await asyncio.sleep(args.settle)  # the re-split's pause and the replayed prefills pass first
        t0 = time.perf_counter()
        await asyncio.sleep(args.measure)
        r = load.rate(t0, time.perf_counter())
        report.say(f"  split {split}: {r:.1f} tok/s")
        return r

    try:
        await asyncio.sleep(args.warm)
        dry = await asyncio.to_thread(rebalance, url, "--dry-run", "--window", str(args.window),
                                      "--streams", str(args.streams))
        proposed, predicted = dry["split_proposed"], dry["predicted_gain"]
        report.say(f"rebalance --dry-run at split {dry['split_now']}: ms/layer "
                   f"{' / '.join(str(s['ms_per_layer']) for s in dry['stages'])}; proposes {proposed}, "
                   f"predicted {predicted:.3f}x")
        if proposed == args.split:
            raise SystemExit("the proposal is the split running: nothing to compare (start more lopsided)")
        rates: dict[str, list[float]] = {args.split: [], proposed: []}
        rates[args.split].append(await rate(args.split))
        for _ in range(args.rounds):
            for split in (proposed, args.split):
                await asyncio.to_thread(rebalance, url, "--split", split)
                rates[split].append(await rate(split))
        gains = [p / statistics.mean(rates[args.split][i:i + 2]) for i, p in enumerate(rates[proposed])]
        measured = statistics.median(gains)
        report.say(f"measured gain {measured:.3f}x (each round: {', '.join(f'{g:.3f}' for g in gains)}); predicted "
                   f"{predicted:.3f}x: the prediction is {abs(predicted - measured) / measured:.1%} off the measured "
                   f"gain; {load.failed} failed requests")
        return {"dry_run": dry, "rates": rates, "gains": gains, "measured_gain": measured, "predicted_gain": predicted,
                "off_by": abs(predicted - measured) / measured, "failed": load.failed}
    finally:
        load.stop.set()
        await runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="24", help="the split the mesh starts with (default 24: lopsided for SmolLM2)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warm", type=float, default=10.0, help="seconds of load before rebalance measures (default 10)")
    p.add_argument("--window", type=float, default=10.0, help="rebalance --window (default 10 s)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after each re-split before measuring")
    p.add_argument("--measure", type=float, default=15.0, help="seconds each split's throughput is measured over")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quotas", default=None, help="each stage's share of one core of its own, e.g. 1,0.5 (default: "
                                                  "not pinned, not throttled)")
    add_out_arg(p, "rebalance_gain")
    args = p.parse_args()
    report = Report("rebalance_gain", args.out)
    slow = "" if args.quotas is None else f", each stage on a core of its own at {args.quotas} of it"
    report.say(f"SmolLM2, 2 stages from split {args.split}{slow}, {args.streams} streams, --compile-decode off")
    flags = ["--split", args.split, "--compile-decode", "off", "--auto-rebalance", "off"]  # moved only when asked
    if args.quotas is None:
        with running_up(2, *flags, compiled=False) as gw:
            result = asyncio.run(run(gw.url, args, report))
    else:
        quotas = [float(q) for q in args.quotas.split(",")]
        with contextlib.ExitStack() as stack:
            gw, _ = start_pinned(stack, quotas, args.streams, *flags)
            result = asyncio.run(run(gw.url, args, report))
    report.write({**result, "args": vars(args)})


if __name__ == "__main__":
    main()
