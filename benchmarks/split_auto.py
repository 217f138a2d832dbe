"""`up --split auto` on uneven hosts (issue 58): a 2-stage mesh whose stages are pinned to a core each and throttled
to --quotas of that core from the moment they start (cgroup v1 cpu.cfs_quota_us), so the calibration each stage runs
at start sees its real speed. Measures the throughput of --split auto under --streams streams, and of every static
--split in --sweep under the same throttle; prints auto's over the best static split's.

    python -m benchmarks.split_auto --quotas 1.0,0.5 --streams 16 --sweep 15,17,19,21,23,25

The gateway (the `up` process) is pinned to --gateway-core (default 1, the throttled stage's core, whose other half
is idle): on a 2-core machine it shares a core with a stage either way. Needs a writable /sys/fs/cgroup/cpu (root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time

from services.testing.harness import Load, Report, add_out_arg
from services.testing.slow_host import can_throttle, start_pinned


def run_one(split: str, args) -> dict:
    """One `up --split SPLIT` with the stages slowed from their start; its throughput over --measure seconds."""
    with contextlib.ExitStack() as stack:
        quotas = [float(q) for q in args.quotas.split(",")]
        t0 = time.perf_counter()
        gw, slow = start_pinned(stack, quotas, args.streams, "--split", split, "--compile-decode", "off",
                                "--insecure-plaintext", "--auto-rebalance", "off", gateway_core=args.gateway_core)
        ready_s = time.perf_counter() - t0
        if sorted(slow.done) != list(range(len(quotas))):
            raise SystemExit(f"only stages {sorted(slow.done)} were slowed at start")
        load = Load(gw.url, args.streams, args.max_tokens)

        async def measure() -> float:
            runner = asyncio.create_task(load.run())
            await asyncio.sleep(args.warm + args.measure)
            end = time.perf_counter()
            load.stop.set()
            await runner
            return load.rate(end - args.measure, end)

        rate = asyncio.run(measure())
        pipe = json.loads(gw.get("/v1/mesh")[1])["pipelines"][0]  # after: the view samples every tick
        return {"split": pipe["split"], "tokens_per_s": round(rate, 2), "failed": load.failed,
                "ready_s": round(ready_s, 1),
                "split_auto": pipe.get("split_auto") and {k: pipe["split_auto"][k] for k in ("state", "summary")},
                "proposal": pipe.get("split_auto") and pipe["split_auto"]["proposal"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quotas", default="1.0,0.5", help="each stage's share of its core, in order (default 1.0,0.5)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sweep", default="15,17,19,21,23,25", help="static splits to measure (comma-separated)")
    p.add_argument("--warm", type=float, default=5.0, help="seconds of load before the measured window")
    p.add_argument("--measure", type=float, default=20.0, help="seconds measured")
    p.add_argument("--gateway-core", type=int, default=1, help="the core the gateway is pinned to (default 1)")
    add_out_arg(p, "split-auto")
    args = p.parse_args()
    if not can_throttle():
        raise SystemExit("/sys/fs/cgroup/cpu is not writable: run as root where the cgroup v1 cpu controller is")
    report = Report("split_auto", args.out)
    report.say(f"2 stages pinned to cores 0 and 1, throttled to {args.quotas} of their core from start; gateway on "
               f"core {args.gateway_core}; {args.streams} streams x {args.max_tokens} tokens, {args.measure:g} s "
               f"measured after {args.warm:g} s; load average before {os.getloadavg()[0]:.2f} (a shared machine)")
    autos = []

    def run_auto() -> None:  # before and after the sweep: the machine's load drifts over a run
        autos.append(run_one("auto", args))
        a = autos[-1]
        report.say(f"--split auto: chose {a['split']} ({a['split_auto']['summary']}); ready in {a['ready_s']} s; "
                   f"{a['tokens_per_s']} tok/s, {a['failed']} failed; load average {os.getloadavg()[0]:.2f}")

    run_auto()
    statics = {}
    for split in [s.strip() for s in args.sweep.split(",") if s.strip()]:
        statics[split] = run_one(split, args)
        report.say(f"--split {split}: {statics[split]['tokens_per_s']} tok/s, {statics[split]['failed']} failed; "
                   f"load average {os.getloadavg()[0]:.2f}")
    run_auto()
    best = max(statics, key=lambda s: statics[s]["tokens_per_s"])
    auto_rate = sum(a["tokens_per_s"] for a in autos) / len(autos)
    ratio = auto_rate / statics[best]["tokens_per_s"]
    report.say(f"best static split {best}: {statics[best]['tokens_per_s']} tok/s; --split auto (chose "
               f"{' then '.join(a['split'] for a in autos)}, mean {auto_rate:.2f} tok/s) / best static = {ratio:.2f} "
               "(target >= 0.9)")
    report.write({"auto": autos, "static": statics, "best_static": best, "auto_tokens_per_s": round(auto_rate, 2),
                  "ratio": round(ratio, 3), "args": vars(args)})


if __name__ == "__main__":
    main()
