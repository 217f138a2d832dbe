"""A stage that leaves, and the time until its place serves again (issue 58, item 4): on a mesh of --stages stages
(as `stagemesh up` starts them, CURVE on), one stage at a time is SIGKILLed and put back either by a new process with
the same command (what `up` does without spares, and a StatefulSet for a pod) or by a spare (`up --spares 1`: a
`stagemesh spare` process that has imported the runtime and opened the file, and is ordered to take the place). The
two ways alternate, --rounds times each, stage 0, 1, ... in turn; each time is from the kill's exit to the stage's
/ready (its weights loaded, its sockets bound). A spare is let finish its own start before the next kill.

    python -m benchmarks.spare [--model smollm2] [--stages 2] [--rounds 4] [--out DIR]"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

from services.process.launch import SparePool, start_mesh, wait_ready
from services.testing.harness import Report, add_out_arg


def spare_waiting(log_dir: str, started: int, timeout: float = 120.0) -> float:
    """Seconds until spare number `started` says it is ready (its log line), after its start."""
    path, t0 = os.path.join(log_dir, f"spare{started}.log"), time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            with open(path) as f:
                if "spare ready" in f.read():
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"spare {started} not ready after {timeout} s (see {path})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    add_out_arg(p, "spare")
    args = p.parse_args()
    report = Report("spare", args.out)
    log_dir = tempfile.mkdtemp(prefix="stagemesh-spare-")
    mesh = start_mesh(args.model, args.stages, log_dir=log_dir, extra=["--compile-decode", "off"])
    pool = SparePool(args.model, 1, env=mesh.stages[0].env, log_dir=log_dir)
    times: dict[str, list[float]] = {"restart": [], "spare": []}
    try:
        spare_waiting(log_dir, pool.started)
        report.say(f"{args.model}, {args.stages} stages, CURVE, --compile-decode off; a stage SIGKILLed and put back "
                   f"{args.rounds} times each way")
        for r in range(2 * args.rounds):
            way = ("restart", "spare")[r % 2]
            stage = mesh.stages[(r // 2) % args.stages]
            stage.proc.send_signal(signal.SIGKILL)
            stage.proc.wait()
            t0 = time.perf_counter()
            mesh.restart_dead(pool if way == "spare" else None)
            wait_ready([stage.url], 300, procs=[stage.proc])
            dt = time.perf_counter() - t0
            times[way].append(dt)
            report.say(f"  {way:7s} stage {stage.index}: ready {dt:.2f} s after the kill"
                       + (f" (spare pid {stage.proc.pid})" if way == "spare" else ""))
            if way == "spare":
                spare_waiting(log_dir, pool.started)  # the pool's new spare finishes its own start
        med = {way: statistics.median(ts) for way, ts in times.items()}
        report.say(f"median: restart {med['restart']:.2f} s, spare {med['spare']:.2f} s: the spare's place serves "
                   f"{med['restart'] / med['spare']:.1f}x sooner ({med['restart'] - med['spare']:.2f} s less)")
        report.write({"model": args.model, "stages": args.stages, "times_s": times, "median_s": med})
    finally:
        pool.stop()
        mesh.stop()


if __name__ == "__main__":
    main()
