"""Does each stage overlap receive, compute and send? Prints, per mode (prefetch on / off), each stage's busy
fraction and the pipeline's throughput divided by the ideal 1 / max(stage compute time per micro-batch).

    python -m benchmarks.overlap [--stages 2] [--inflight 4] [--batch 8] [--steps 40] [--dtype bfloat16]

Micro-batches are decode steps of `--batch` sequences each; `--inflight` independent groups are kept in
flight, so a stage always has its next input waiting when it is fast enough to need one."""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import urllib.request

from services.launch import scrape_metric, start_mesh
from shared.generation import SequenceState, run_group_on_mesh
from shared.model_files import ModelFiles


def scrape(url: str) -> tuple[float, int]:
    """(busy seconds, micro-batches) of one stage, from its Prometheus metrics."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    return (scrape_metric(text, "stagemesh_stage_busy_seconds_total"),
            int(scrape_metric(text, "stagemesh_stage_microbatches_total")))


async def run_groups(mesh, prompt: list[int], inflight: int, batch: int, steps: int, warmup: int) -> dict:
    client = mesh.client()
    await client.start()
    t_start: list[float] = []
    before: list = []

    async def group(g: int) -> None:
        states = [SequenceState(f"g{g}s{i}", prompt, max_tokens=1 + warmup + steps) for i in range(batch)]

        async def before_step(i: int) -> None:  # step 0 is the prefill; then warmup decodes, then measured ones
            if i == 1 + warmup:
                await barrier.wait()

        await run_group_on_mesh(client, states, before_step=before_step)

    class Barrier:  # all groups finish warm-up before the measured window opens
        def __init__(self, n):
            self.n, self.event = n, asyncio.Event()

        async def wait(self):
            self.n -= 1
            if self.n == 0:
                before.extend(scrape(u) for u in mesh.stage_urls)
                t_start.append(time.perf_counter())
                self.event.set()
            await self.event.wait()

    barrier = Barrier(inflight)
    await asyncio.gather(*(group(g) for g in range(inflight)))
    elapsed = time.perf_counter() - t_start[0]
    after = [scrape(u) for u in mesh.stage_urls]
    await client.close()
    stages = []
    for (b0, n0), (b1, n1) in zip(before, after):
        stages.append({"busy_fraction": (b1 - b0) / elapsed, "compute_s_per_mb": (b1 - b0) / max(1, n1 - n0)})
    mbs = inflight * steps
    throughput = mbs / elapsed
    ideal = 1.0 / max(s["compute_s_per_mb"] for s in stages)
    return {"elapsed_s": elapsed, "microbatches": mbs, "throughput_mb_s": throughput, "ideal_mb_s": ideal,
            "ratio": throughput / ideal, "stages": stages}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch threads per stage (default cores / stages)")
    args = p.parse_args()
    files = ModelFiles.open(args.model)
    prompt = files.tokenizer.encode("The history of the printing press begins")
    print(f"overlap benchmark: {args.stages} stages, {args.inflight} micro-batches in flight, {args.batch} sequences "
          f"per micro-batch (decode), {args.steps} measured steps, {args.dtype}, {os.cpu_count()} cores")
    results = {}
    modes = [("prefetch on", [], args.inflight), ("prefetch off", ["--no-prefetch"], args.inflight),
             ("1 in flight", [], 1)]
    for mode, extra, inflight in modes:
        with tempfile.TemporaryDirectory() as logs:
            mesh = start_mesh(args.model, args.stages, dtype=args.dtype, threads=args.threads, extra=extra, log_dir=logs)
            try:
                mesh.wait_compiled()  # steady state: --compile-decode auto compiles after /ready
                r = asyncio.run(run_groups(mesh, prompt, inflight, args.batch, args.steps, args.warmup))
            finally:
                mesh.stop()
        results[mode] = r
        busy = "  ".join(f"stage{i} busy {s['busy_fraction']:.3f} ({s['compute_s_per_mb'] * 1e3:.1f} ms/mb)"
                         for i, s in enumerate(r["stages"]))
        print(f"{mode:>13} ({inflight} in flight): {busy}  throughput {r['throughput_mb_s']:.2f} mb/s, ideal {r['ideal_mb_s']:.2f} mb/s, "
              f"ratio {r['ratio']:.3f}")
    on, off = results["prefetch on"], results["prefetch off"]
    one = results["1 in flight"]
    print(f"prefetch on / off throughput: {on['throughput_mb_s'] / off['throughput_mb_s']:.2f}x; "
          f"{args.inflight} in flight / 1 in flight: {on['throughput_mb_s'] / one['throughput_mb_s']:.2f}x")


if __name__ == "__main__":
    main()
