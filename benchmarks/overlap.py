"""Does each stage overlap receive, compute and send? Prints, per mode (prefetch on / off), each stage's busy
fraction and the pipeline's throughput divided by the ideal 1 / max(stage compute time per micro-batch).

    python -m benchmarks.overlap [--stages 2] [--inflight 4] [--batch 8] [--steps 40] [--dtype D] [--out DIR]

Micro-batches are decode steps of `--batch` sequences each; `--inflight` independent groups are kept in
flight, so a stage always has its next input waiting when it is fast enough to need one. Writes overlap.json and
overlap.md (what it printed) into --out (default: a new benchmarks/results/<date>-overlap)."""

from __future__ import annotations

import argparse
import asyncio
import os

from services.testing.harness import Report, add_dtype_arg, add_out_arg, dtype_label, run_groups, running_mesh
from shared.runtime.model_files import ModelFiles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads per stage (default cores / stages)")
    add_out_arg(p, "overlap")
    args = p.parse_args()
    report = Report("overlap", args.out)
    files = ModelFiles.open(args.model)
    prompt = files.tokenizer.encode("The history of the printing press begins")
    report.say(f"overlap benchmark: {args.stages} stages, {args.inflight} micro-batches in flight, {args.batch} sequences "
               f"per micro-batch (decode), {args.steps} measured steps, {dtype_label(args.dtype)}, {os.cpu_count()} cores")
    results = {}
    modes = [("prefetch on", [], args.inflight), ("prefetch off", ["--no-prefetch"], args.inflight),
             ("1 in flight", [], 1)]
    for mode, extra, inflight in modes:
        with running_mesh(args.model, args.stages, args.dtype, threads=args.threads, extra=extra) as mesh:
            r = asyncio.run(run_groups(mesh, prompt, inflight, args.batch, args.steps, args.warmup))
        results[mode] = r
        busy = "  ".join(f"stage{i} busy {s['busy_fraction']:.3f} ({s['compute_s_per_mb'] * 1e3:.1f} ms/mb)"
                         for i, s in enumerate(r["stages"]))
        report.say(f"{mode:>13} ({inflight} in flight): {busy}  throughput {r['throughput_mb_s']:.2f} mb/s, ideal {r['ideal_mb_s']:.2f} mb/s, "
                   f"ratio {r['ratio']:.3f}")
    on, off = results["prefetch on"], results["prefetch off"]
    one = results["1 in flight"]
    report.say(f"prefetch on / off throughput: {on['throughput_mb_s'] / off['throughput_mb_s']:.2f}x; "
               f"{args.inflight} in flight / 1 in flight: {on['throughput_mb_s'] / one['throughput_mb_s']:.2f}x")
    report.write({"settings": vars(args) | {"dtype": dtype_label(args.dtype)}, "modes": results})


if __name__ == "__main__":
    main()
