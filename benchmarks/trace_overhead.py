"""Tracing off costs nothing measurable: decode tokens/s of a 2-stage mesh with the capture path idle (no request
traced) against the same mesh with trace handling bypassed (`stagemesh stage --no-trace`), alternating A/B/A/B so
the run-to-run noise is measured in the same session.

    python -m benchmarks.trace_overhead [--rounds 3] [--batch 8] [--steps 30] [--dtype D] [--out DIR]

Writes trace_overhead.json and trace_overhead.md (what it printed) into --out (default: a new
benchmarks/results/<date>-trace_overhead)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics

from services.testing.harness import Report, add_dtype_arg, add_out_arg, dtype_label, run_groups, running_mesh
from shared.runtime.model_files import ModelFiles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    add_dtype_arg(p)
    add_out_arg(p, "trace_overhead")
    args = p.parse_args()
    report = Report("trace_overhead", args.out)
    prompt = ModelFiles.open("smollm2").tokenizer.encode("The history of the printing press begins")
    runs: dict[str, list[float]] = {"idle": [], "bypassed": []}
    with contextlib.ExitStack() as stack:
        meshes = {"idle": stack.enter_context(running_mesh("smollm2", 2, args.dtype)),
                  "bypassed": stack.enter_context(running_mesh("smollm2", 2, args.dtype, extra=["--no-trace"]))}
        for _ in range(args.rounds):
            for mode, mesh in meshes.items():
                r = asyncio.run(run_groups(mesh, prompt, args.inflight, args.batch, args.steps, warmup=3))
                runs[mode].append(r["throughput_mb_s"] * args.batch)
    report.say(f"decode tokens/s, 2 stages, {dtype_label(args.dtype)}, {args.inflight} x {args.batch} sequences, "
               f"{args.rounds} alternating rounds")
    for mode, values in runs.items():
        report.say(f"  {mode:>8}: mean {statistics.mean(values):7.1f}  runs {', '.join(f'{v:.1f}' for v in values)}")
    noise = max(statistics.stdev(v) for v in runs.values()) if args.rounds > 1 else float("nan")
    diff = statistics.mean(runs["idle"]) - statistics.mean(runs["bypassed"])
    report.say(f"  idle - bypassed: {diff:+.1f} tokens/s; run-to-run noise (largest stdev): {noise:.1f} tokens/s; "
               f"{'within' if abs(diff) <= 2 * noise else 'OUTSIDE'} 2x noise")
    report.write({"settings": vars(args) | {"dtype": dtype_label(args.dtype)}, "decode_tokens_per_s": runs})


if __name__ == "__main__":
    main()
