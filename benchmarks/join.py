"""A host that joins, leaves and is lost under load (issue 68): a one-stage `stagemesh up --join-token` serving
--streams streams; `stagemesh join` is started beside it and the benchmark measures the time from its exec to the
first micro-batch it serves, the failed requests, the worst gap between a stream's tokens and the throughput after /
before; then the joined stage leaves (SIGTERM) and, joined again, is SIGKILLed: failed requests, worst gap, and how
long the gateway took to notice the loss.

    python -m benchmarks.join --streams 16 [--compile-decode off] [--pin]

On one machine (no namespaces, no shaped link) both "hosts" share its cores unless --pin gives each a core of its
own (the mesh core 0, the joiner core 1): unpinned, the after / before ratio says what a second process on the same
cores gives; pinned, what a second host of one core gives.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from services.testing.harness import Load, Report, add_out_arg, running_up

TOKEN = "benchmark-join-token-0123456789abcdef"
UP_CORES, JOINER_CORES = {0}, {1}  # --pin


def mesh(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/mesh", timeout=10) as r:
        return json.loads(r.read())["pipelines"][0]


def info(stage_url: str) -> dict:
    with urllib.request.urlopen(stage_url + "/info", timeout=10) as r:
        return json.loads(r.read())


def events(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/v1/mesh/members", timeout=10) as r:
        return json.loads(r.read())["events"]


async def until(check, timeout: float, what: str, every: float = 0.05):
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        got = await asyncio.to_thread(check)
        if got:
            return got
        await asyncio.sleep(every)
    raise SystemExit(f"{what} did not happen within {timeout:g} s")


def worst_gap(load: Load, t0: float, t1: float) -> float:
    """The longest gap between two tokens of one request that ended within [t0, t1] (the disturbance's window: every
    gap, not only each request's worst, which may lie outside it)."""
    return round(max((g for at, g in load.gaps if t0 <= at <= t1), default=0.0), 3)


async def run(url: str, args, log_dir: str, report: Report) -> dict:
    load = Load(url, args.streams, args.max_tokens)
    runner = asyncio.create_task(load.run())
    cmd = [sys.executable, "-m", "services.cli", "join", url, "--token", TOKEN, "--model", args.model, "--as", "stage",
           "--compile-decode", args.compile_decode, "--listen", "tcp://127.0.0.1:0", "--http", "127.0.0.1:0"]
    joins = 0

    def start_joiner() -> subprocess.Popen:
        nonlocal joins
        joins += 1
        with open(os.path.join(log_dir, f"join{joins}.log"), "w") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=(lambda: os.sched_setaffinity(0, JOINER_CORES)) if args.pin else None)

    def serving(stages: int, joiner: subprocess.Popen | None = None):
        """The mesh has `stages` stages and each has computed: its own /info's count (the gateway's view of it is
        as old as its last poll, up to 2 s). SystemExit when `joiner` exited meanwhile (its log says why)."""
        def check():
            if joiner is not None and joiner.poll() is not None:
                raise SystemExit(f"the joiner exited ({joiner.returncode}): see its log in {log_dir}")
            p = mesh(url)
            return (len(p["stages"]) == stages and p["ready"] and all(s.get("layers") for s in p["stages"])
                    and all(info(s["url"]).get("microbatches") for s in p["stages"]) and p["stages"])
        return check

    await asyncio.sleep(args.warm)
    t = time.perf_counter()
    before = load.rate(t - args.measure, t)
    failed = load.failed
    # join: exec -> the first micro-batch it serves (its /info's microbatches counter, through /v1/mesh)
    t_exec, wall_exec = time.perf_counter(), time.time()
    joiner = start_joiner()
    await until(serving(2, joiner), 300, "the join")
    joined_in = time.perf_counter() - t_exec
    # where the time went, from the gateway's membership events: the joiner's start (imports, its probe) until
    # placed; its loading until the change; the change itself (its pause inside it)
    seen = {e["event"]: e for e in events(url) if e["time"] >= wall_exec}
    placed, joined = seen["placed"], seen["joined"]
    phases = {"exec_to_placed_s": round(placed["time"] - wall_exec, 2),
              "placed_to_ready_s": round(joined["time"] - joined["took_s"] - placed["time"], 2),
              "change_s": joined["took_s"], "pause_s": joined["pause_s"], "kv_moved": joined.get("kv_moved")}
    await asyncio.sleep(args.measure + 2)
    t_end = time.perf_counter()
    after = load.rate(t_end - args.measure, t_end)
    rows = {"join": {"exec_to_first_microbatch_s": round(joined_in, 2), "failed": load.failed - failed,
                     "worst_gap_s": worst_gap(load, t_exec, t_end), "tokens_per_s_before": round(before, 1),
                     "tokens_per_s_after": round(after, 1), "after_over_before": round(after / before, 3),
                     **phases}}
    report.say(f"join: exec -> first micro-batch {joined_in:.1f} s; {rows['join']['failed']} failed; worst gap "
               f"{rows['join']['worst_gap_s']} s; {before:.1f} -> {after:.1f} tok/s ({after / before:.2f}x); "
               f"exec -> placed {phases['exec_to_placed_s']} s, placed -> ready {phases['placed_to_ready_s']} s, "
               f"the change {phases['change_s']} s (paused {phases['pause_s']} s, K/V moved: {phases['kv_moved']})")
    # leave: SIGTERM; the mesh back to one stage
    failed, t0 = load.failed, time.perf_counter()
    joiner.send_signal(signal.SIGTERM)
    await until(serving(1), 120, "the leave")
    left_in = time.perf_counter() - t0
    await asyncio.to_thread(joiner.wait, 60)
    await asyncio.sleep(args.settle)
    left = [e for e in events(url) if e["event"] == "left"][-1]
    rows["leave"] = {"left_in_s": round(left_in, 2), "failed": load.failed - failed,
                     "worst_gap_s": worst_gap(load, t0, time.perf_counter()), "pause_s": left["pause_s"],
                     "kv_moved": left.get("kv_moved")}
    report.say(f"leave: back to one stage in {left_in:.1f} s; {rows['leave']['failed']} failed; worst gap "
               f"{rows['leave']['worst_gap_s']} s")
    # loss: join again, SIGKILL; noticed = the gateway's "noticed" event after the kill
    joiner = start_joiner()
    await until(serving(2, joiner), 300, "the second join")
    await asyncio.sleep(args.settle)
    failed, t0, wall = load.failed, time.perf_counter(), time.time()
    os.kill(joiner.pid, signal.SIGKILL)
    noticed = await until(lambda: [e for e in events(url) if e["event"] == "noticed" and e["time"] >= wall], 60,
                          "noticing the loss")
    await until(serving(1), 120, "covering the loss")
    covered_in = time.perf_counter() - t0
    await asyncio.sleep(args.settle)
    rows["loss"] = {"noticed_within_s": round(noticed[0]["time"] - wall, 2), "covered_in_s": round(covered_in, 2),
                    "failed": load.failed - failed, "worst_gap_s": worst_gap(load, t0, time.perf_counter())}
    report.say(f"loss: noticed within {rows['loss']['noticed_within_s']} s, covered in {covered_in:.1f} s; "
               f"{rows['loss']['failed']} failed; worst gap {rows['loss']['worst_gap_s']} s")
    load.stop.set()
    await runner
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile-decode", default="off", choices=["auto", "on", "off"],
                   help="the stages' --compile-decode (default off: a compile in the background would share the cores "
                        "with what is measured)")
    p.add_argument("--warm", type=float, default=20.0, help="seconds of load before the join (default 20)")
    p.add_argument("--measure", type=float, default=15.0, help="seconds each throughput is measured over (default 15)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of load after each change (default 5)")
    p.add_argument("--pin", action="store_true",
                   help="a core a host: the one-stage mesh (its gateway and stage) on core 0, each joiner on core 1 "
                        "(their threads follow: shared.cpu.usable_cores)")
    p.add_argument("--log-dir", default=None, help="keep the processes' logs here (default: a temporary directory)")
    add_out_arg(p, "join")
    args = p.parse_args()
    report = Report("join", args.out)
    where = ("the one-stage mesh pinned to core 0, the joiner to core 1" if args.pin else
             f"{os.cpu_count()} cores shared by both processes")
    report.say(f"{args.model} {args.dtype}, a one-stage up --join-token, {args.streams} streams of {args.max_tokens} "
               f"tokens, --compile-decode {args.compile_decode}, {where}")
    everywhere = os.sched_getaffinity(0)
    if args.pin:  # what `up` starts inherits core 0 (its gateway and stage: one host); a joiner gets core 1
        os.sched_setaffinity(0, UP_CORES)
    with (contextlib.nullcontext(args.log_dir) if args.log_dir else tempfile.TemporaryDirectory()) as logs, \
            running_up(1, "--model", args.model, "--join-token", TOKEN, "--compile-decode", args.compile_decode,
                       "--auto-rebalance", "off",
                       "--kv-slots", str(max(32, args.streams)), dtype=args.dtype, compiled=False, log_dir=logs) as gw:
        os.sched_setaffinity(0, everywhere)  # the load's client: any core
        rows = asyncio.run(run(gw.url, args, logs, report))
    report.write({**rows, "args": vars(args)})


if __name__ == "__main__":
    main()
