"""Recovery from an uneven host by a live re-split (issue 58): a 2-stage `stagemesh up --auto-rebalance` under
--streams streams; after --warm seconds one stage is throttled to --quota of its CPU (cgroup v1 cpu.cfs_quota_us),
the gateway measures, re-splits live, and the benchmark measures the throughput before the throttle, throttled
before the re-split, and after it settles, the time from the throttle to the re-split, the worst gap between a
stream's tokens and the failed requests. --static SPLITS also measures those splits started static under the same
throttle (the best of them is what the re-split should recover >= 90 % of).

    python -m benchmarks.resplit --streams 16 --quota 0.5 --throttle-stage 1 [--static "12;15;18"] [--pinned]

Needs a writable cgroup v1 cpu controller (/sys/fs/cgroup/cpu): it makes one group per throttled stage and removes it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import urllib.request

from services.testing.harness import Load, Report, add_out_arg, running_up
from services.testing.slow_host import start_pinned, throttled


def mesh(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/mesh", timeout=10) as r:
        return json.loads(r.read())["pipelines"][0]


async def measure(url: str, pid: int, args, auto: bool, share: float) -> dict:
    """share: the throttled stage's share of the machine's CPU."""
    load = Load(url, args.streams, args.max_tokens)
    runner = asyncio.create_task(load.run())
    await asyncio.sleep(args.warm)
    t_throttle = time.perf_counter()
    before = load.rate(t_throttle - args.warm / 2, t_throttle)
    wall_throttle, first_resplit, latest, seen = time.time(), None, None, 0
    with throttled(pid, share):
        last_deadline = t_throttle + args.settle + args.after
        deadline = t_throttle + (args.settle if auto else args.static_settle)
        while time.perf_counter() < deadline:
            await asyncio.sleep(1.0)
            done = [r for r in mesh(url)["resplits"] if r["outcome"] == "done" and r["time"] >= wall_throttle]
            if auto and len(done) > seen:  # a re-split since the throttle: measure --after s from the latest one
                seen, latest = len(done), time.perf_counter()
                first_resplit = first_resplit or latest
                deadline = min(last_deadline, latest + args.after)
        end = time.perf_counter()
        load.stop.set()
        await runner
    throttled_rate = load.rate(t_throttle + 2, (first_resplit or end))
    after = load.rate(max(end - args.after / 2, (latest or t_throttle) + 2), end)
    return {"split_end": mesh(url)["split"], "resplits": mesh(url)["resplits"],
            "tokens_per_s_before": round(before, 2), "tokens_per_s_throttled": round(throttled_rate, 2),
            "tokens_per_s_after": round(after, 2),
            "resplit_after_s": None if first_resplit is None else round(first_resplit - t_throttle, 2),
            "worst_gap_s": round(max((g for _, g in load.worst_gap), default=0.0), 3), "failed": load.failed}


def run_one(split: str, args, auto: bool) -> dict:
    flags = ["--split", split, "--compile-decode", "off", "--batch-invariant"]
    flags += ["--auto-rebalance", "on", "--rebalance-window", str(args.window)] if auto else ["--auto-rebalance", "off"]
    if not args.pinned:
        with running_up(2, *flags, compiled=False) as gw:
            pid = gw.stage_pids()[args.throttle_stage]
            return asyncio.run(measure(gw.url, pid, args, auto, args.quota))
    with contextlib.ExitStack() as stack:  # two hosts: each stage alone on a core, the throttle a share of that core
        gw, _ = start_pinned(stack, [1.0, 1.0], args.streams, *flags,
                             gateway_core=args.throttle_stage % (os.cpu_count() or 1))
        return asyncio.run(measure(gw.url, gw.stage_pids()[args.throttle_stage], args, auto,
                                   args.quota / (os.cpu_count() or 1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--split", default="15", help="the split the mesh starts with (default 15)")
    p.add_argument("--throttle-stage", type=int, default=1, help="which stage is throttled (default 1)")
    p.add_argument("--quota", type=float, default=0.5, help="its share of the machine's CPU (default 0.5)")
    p.add_argument("--window", type=float, default=5.0, help="--rebalance-window of the gateway (default 5 s)")
    p.add_argument("--warm", type=float, default=20.0, help="seconds of load before the throttle (default 20)")
    p.add_argument("--settle", type=float, default=90.0, help="seconds to wait for a re-split (default 90)")
    p.add_argument("--after", type=float, default=30.0, help="seconds measured after the first re-split (default 30)")
    p.add_argument("--static", default="", help="splits (semicolon-separated) also measured static, throttled")
    p.add_argument("--static-settle", type=float, default=30.0,
                   help="seconds each static split runs throttled; its last --after/2 are measured (default 30)")
    p.add_argument("--pinned", action="store_true",
                   help="each stage pinned to a core of its own (--threads-alone 1), as on two hosts, and the gateway to "
                        "the throttled stage's core (the host with room to spare); --quota a share of its core (default: both stages share every core, --quota a share of the machine)")
    add_out_arg(p, "resplit")
    args = p.parse_args()
    report = Report("resplit", args.out)
    where = "its core (each stage on a core of its own)" if args.pinned else "the CPU"
    report.say(f"2 stages, split {args.split}, stage {args.throttle_stage} throttled to {args.quota:.0%} of {where} "
               f"after {args.warm:g} s, {args.streams} streams, --rebalance-window {args.window:g}")
    auto = run_one(args.split, args, auto=True)
    report.say(f"auto: {auto['tokens_per_s_before']} tok/s before, {auto['tokens_per_s_throttled']} throttled, "
               f"{auto['tokens_per_s_after']} after the re-split to {auto['split_end']} (first one "
               f"{auto['resplit_after_s']} s after the throttle); worst gap {auto['worst_gap_s']} s; "
               f"{auto['failed']} failed requests")
    statics = {}
    for split in [s for s in args.static.split(";") if s.strip()]:
        statics[split] = run_one(split, args, auto=False)
        report.say(f"static {split}: {statics[split]['tokens_per_s_after']} tok/s throttled")
    if statics:
        best = max(statics.values(), key=lambda r: r["tokens_per_s_after"])
        report.say(f"re-split recovers {auto['tokens_per_s_after'] / best['tokens_per_s_after']:.0%} of the best "
                   f"static split's throughput under the throttle")
    report.write({"auto": auto, "static": statics, "args": vars(args)})


if __name__ == "__main__":
    main()
