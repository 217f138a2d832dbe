"""A replica of the bottleneck (issue 68 item 3's target): a 2-stage mesh whose stage 1 runs at half speed, then a
third process joins as stage 1's replica. Tok/s at --streams streams with the replica over without it; then one of
stage 1's two processes is SIGKILLed under the load: how many requests failed (the issue: 0).

The hosts (services/testing/slow_host.py, start_pinned): stage 0 pinned to core 0; stage 1 pinned to core 1 and held
to --quota of it (cgroup v1 cpu.cfs_quota_us, from its start); the joiner (`stagemesh join --as replica`) pinned to
core 1 and held to --quota of it too, from the moment its process exists (before it measures itself). The gateway and
the load generator are not pinned. `--kill primary` kills the process stage 1 was started as (its replica is promoted
to its place), `--kill replica` the joined one; either way only the sequences on the dead process replay.

    python -m benchmarks.stage_replicas [--model smollm2] [--streams 32] [--max-tokens 32] [--warm 10] [--measure 20]
                                        [--quota 0.5] [--split 15] [--kill primary|replica] [--out DIR]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from services.testing.harness import Load, Report, add_out_arg
from services.testing.slow_host import pin, start_pinned, throttled

TOKEN = "stage-replicas-benchmark-token-0123456789"
JOIN_WAIT_S = 300.0


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def join_replica(stack: contextlib.ExitStack, gw_url: str, model: str, like: dict, streams: int, quota: float,
                 log_dir: str):
    """`stagemesh join --as replica` with the mesh's numerics (dtype, weights: with `--dtype` alone the joiner ran
    f32 weights, ~4x slower per micro-batch than up's default here), on core 1 at `quota` of it from its start; returns
    (its process, its /v1/mesh/members entry) once the gateway binds sequences to it."""
    log = open(os.path.join(log_dir, "replica.log"), "w")
    stack.callback(log.close)
    cmd = [sys.executable, "-m", "services.cli", "join", gw_url, "--token", TOKEN, "--model", model,
           "--dtype", like["dtype"], "--weights", like["weights_mode"], "--kv-slots", str(streams), "--max-seq-len", str(like["kv_max_seq_len"]),
           "--compile-decode", "off", "--threads", "1", "--listen", "tcp://127.0.0.1:0", "--http", "127.0.0.1:0",
           "--as", "replica"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(lambda: proc.poll() is None and proc.kill())
    stack.enter_context(throttled(proc.pid, quota / (os.cpu_count() or 1)))
    pin(proc.pid, {1 % (os.cpu_count() or 1)})
    deadline = time.monotonic() + JOIN_WAIT_S
    while time.monotonic() < deadline:
        pin(proc.pid, {1 % (os.cpu_count() or 1)})  # the threads it started since
        replicas = get(gw_url + "/v1/mesh/members")["replicas"]
        if replicas:
            (replica,) = replicas.values()
            return proc, replica
        if proc.poll() is not None:
            raise SystemExit(f"the joiner exited: {open(log.name).read()[-2000:]}")
        time.sleep(0.5)
    raise SystemExit(f"the joiner was not a replica within {JOIN_WAIT_S:g} s: {open(log.name).read()[-2000:]}")


async def run(gw, slow, stack: contextlib.ExitStack, args, report: Report) -> dict:
    load = Load(gw.url, args.streams, args.max_tokens)
    runner = asyncio.create_task(load.run())

    async def rate(what: str) -> float:
        t0 = time.perf_counter()
        await asyncio.sleep(args.measure)
        r = load.rate(t0, time.perf_counter())
        report.say(f"  {what}: {r:.1f} tok/s over {args.measure:g} s")
        return r

    try:
        await asyncio.sleep(args.warm)
        alone = await rate("no replica")
        like = get(gw.stage_urls()[1] + "/info")  # the numerics the joiner must match (dtype, context)
        t_join = time.perf_counter()
        proc, replica = await asyncio.to_thread(join_replica, stack, gw.url, args.model, like, args.streams, args.quota,
                                                os.path.dirname(gw.log_path))
        report.say(f"  the replica joined ({replica['url']}) {time.perf_counter() - t_join:.1f} s after its exec")
        slow.repin()
        await asyncio.sleep(args.warm)  # its sequences' prefills, and the others' chains, settle
        both = await rate("with the replica")
        instances = get(gw.url + "/v1/mesh")["pipelines"][0].get("instances") or []
        for inst in (instances[1] if len(instances) > 1 else []):
            i = get(inst["url"] + "/info")
            report.say(f"    stage 1 {'primary' if inst['primary'] else 'replica'} {inst['url']}: "
                       f"{inst['sequences']} sequences, {inst['ms_per_micro_batch']} ms per micro-batch "
                       f"({i['microbatches']} micro-batches, {i['busy_seconds']:.1f} s busy, {i['cpu_seconds']:.1f} s "
                       f"CPU, cgroup limit {i['cpu_limit']:g} cores, {i['dtype']} {i['weights_mode']}, threads "
                       f"{i['threads']}/{i['threads_alone']})")
        failed_before = load.failed
        victim = slow.done[1] if args.kill == "primary" else proc.pid
        os.kill(victim, signal.SIGKILL)
        t_kill = time.perf_counter()
        report.say(f"  SIGKILLed stage 1's {args.kill} (pid {victim}) under the load")
        await asyncio.sleep(args.warm)
        after = await rate(f"after the kill (the {'replica alone' if args.kill == 'primary' else 'primary alone'})")
        failed = load.failed - failed_before
        events = get(gw.url + "/v1/mesh/members")["events"]
        gaps = [g for t, g in load.worst_gap if t >= t_kill]
        report.say(f"ratio with the replica over without: {both / alone:.2f}x; after the kill: {failed} failed "
                   f"requests (before it {failed_before}), worst inter-token gap after it "
                   f"{max(gaps, default=0.0):.2f} s")
        return {"split": args.split, "instances_with_replica": instances, "no_replica_tok_s": alone, "replica_tok_s": both, "ratio": both / alone, "after_kill_tok_s": after,
                "killed": args.kill, "failed_after_kill": failed, "failed_before_kill": failed_before,
                "worst_gap_after_kill_s": max(gaps, default=0.0),
                "membership_events": [e for e in events if e.get("event") in ("noticed", "lost", "promoted",
                                                                               "joined", "placed")]}
    finally:
        load.stop.set()
        await runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="an alias or a GGUF path, e.g. a shaped file built by "
                   "`python -m services.testing.shaped_gguf llama3.2-3b` (default smollm2)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warm", type=float, default=10.0, help="seconds of load before each measurement (default 10)")
    p.add_argument("--measure", type=float, default=20.0, help="seconds each throughput is measured over")
    p.add_argument("--quota", type=float, default=0.5, help="stage 1's and its replica's share of core 1 "
                                                            "(default 0.5)")
    p.add_argument("--split", default="15", help="the mesh's split (default 15: 15 layers each, so the throttled "
                                                 "stage 1 is the bottleneck; auto would give it fewer)")
    p.add_argument("--kill", choices=["primary", "replica"], default="primary",
                   help="which of stage 1's two processes is SIGKILLed (default: primary, the one it started as)")
    add_out_arg(p, "stage-replicas")
    args = p.parse_args()
    report = Report("stage_replicas", args.out)
    report.say(f"{args.model}, 2 stages split at {args.split}: stage 0 on core 0, stage 1 on core 1 at {args.quota:g} of it, a joined replica "
               f"of stage 1 on core 1 at {args.quota:g} of it; {args.streams} streams of {args.max_tokens} tokens, "
               "--compile-decode off, --auto-rebalance off; the gateway and the load not pinned")
    with contextlib.ExitStack() as stack:
        gw, slow = start_pinned(stack, [1.0, args.quota], args.streams, "--model", args.model, "--split", args.split,
                                "--compile-decode", "off",
                                "--auto-rebalance", "off", "--join-token", TOKEN)
        result = asyncio.run(run(gw, slow, stack, args, report))
    report.write({**result, "args": vars(args)})


if __name__ == "__main__":
    main()
