"""`stagemesh plan`'s one-stream prediction against the real mesh on this machine (issue 52: within 20 %).

    python -m benchmarks.plan_check [--rounds 3] [--tokens 128] [--dtype D] [--out DIR]

Times SmolLM2's decode steps here as `plan` does (services.cli.plan.measure_here: eager, every core), predicts one
stream's tok/s for `up --stages 1` and `--stages 2` on loopback (RTT 0, each stage a "host" of this machine's speed,
the split `up` runs), then streams greedy requests through both (`--compile-decode off`: eager, as measured), taking
turns, and prints predicted, measured and their ratio. A request's speed is 1 / its median inter-token time. The
machine is timed again after the requests and the prediction uses the mean of both timings (this VM's speed drifts
by tens of percent over minutes). Writes plan_check.json and plan_check.md into --out (default: a new
benchmarks/results/<date>-plan-check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import urllib.request
from dataclasses import replace

from services.cli.plan import Measured, measure_here
from services.testing.harness import Report, add_dtype_arg, add_out_arg, dtype_label, run_level, ups_in_turn
from shared.files.layers import LayerRange
from shared.models.device import default_device, resolve_dtype
from shared.models.memory import available_bytes
from shared.runtime.model_files import ModelFiles
from shared.runtime.plan import Host, ModelFacts, Workload, predict
from shared.wire.stage_info import StageInfo

TARGET = 0.2  # issue 52: predictions within 20 % of what is measured


def stage_ranges(url: str) -> list[LayerRange]:
    """The layer ranges the stages of the `up` at `url` serve (their /info)."""
    with urllib.request.urlopen(url + "/ready", timeout=5) as r:
        stages = json.loads(r.read())["stages"]
    ranges = []
    for s in stages:
        with urllib.request.urlopen(s + "/info", timeout=5) as r:
            ranges.append(LayerRange(*StageInfo.from_json(json.loads(r.read())).layers))
    return ranges


def mean_measure(a: Measured, b: Measured) -> Measured:
    return replace(a, ms_per_layer=(a.ms_per_layer + b.ms_per_layer) / 2, head_ms=(a.head_ms + b.head_ms) / 2,
                   overhead_ms=(a.overhead_ms + b.overhead_ms) / 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="requests through each mesh, taking turns (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="output tokens of each request (default 128)")
    add_dtype_arg(p)
    add_out_arg(p, "plan-check")
    args = p.parse_args()
    if args.rounds < 1 or args.tokens < 16:
        p.error("--rounds must be >= 1 and --tokens >= 16")
    report = Report("plan-check", args.out)
    files = ModelFiles.open("smollm2")
    threads = os.cpu_count() or 1
    model = ModelFacts.from_gguf(files.loader, resolve_dtype(args.dtype, default_device()).itemsize)
    before = measure_here(files, args.dtype, threads, 1)
    measured: dict[int, list[float]] = {1: [], 2: []}
    with contextlib.ExitStack() as stack:
        urls = ups_in_turn(stack, [1, 2], "smollm2", args.dtype, ["--compile-decode", "off"])
        ranges = {n: stage_ranges(url) for n, url in urls.items()}
        for url in urls.values():  # warm-up, outside the rounds
            asyncio.run(run_level(url, 1, 16, temperature=0.0))
        for i in range(args.rounds):
            for n in ([1, 2] if i % 2 == 0 else [2, 1]):
                level = asyncio.run(run_level(urls[n], 1, args.tokens, temperature=0.0))
                measured[n].append(1e3 / level.itl_ms_p50)
                print(f"  round {i + 1}, {n} stage(s): {measured[n][-1]:.1f} tok/s", flush=True)
    after = measure_here(files, args.dtype, threads, 1)
    m = mean_measure(before, after)
    host = Host("here", available_bytes(), m.ms_per_layer, m.head_ms, overhead_ms=m.overhead_ms)
    report.say(f"SmolLM2, one stream, {args.tokens} tokens a request, {args.rounds} rounds, eager decode "
               f"({dtype_label(args.dtype)}), {threads} threads")
    for name, t in (("before", before), ("after", after)):
        report.say(f"measured {name} the requests: {t.ms_per_layer:.3f} ms a layer, head {t.head_ms:.2f} ms, "
                   f"{t.overhead_ms:.2f} ms fixed a step")
    rows = []
    report.say("stages  layers          predicted tok/s  measured tok/s (median; each round)  measured / predicted")
    for n in (1, 2):
        hosts = [replace(host, name=f"s{i}") for i in range(n)]
        pred = predict(model, hosts, ranges[n], Workload(1, args.tokens + 64))
        med = statistics.median(measured[n])
        rows.append({"stages": n, "layers": [str(r) for r in ranges[n]], "predicted_tok_s": pred.tokens_per_s,
                     "predicted_token_ms": pred.token_ms, "measured_tok_s": measured[n], "measured_median": med,
                     "ratio": med / pred.tokens_per_s})
        report.say(f"{n:<8}{' '.join(map(str, ranges[n])):<16}{pred.tokens_per_s:>15.1f}  {med:>14.1f} ("
                   f"{', '.join(f'{x:.1f}' for x in measured[n])})  {med / pred.tokens_per_s:>8.3f}")
    pred_ratio = rows[1]["predicted_tok_s"] / rows[0]["predicted_tok_s"]
    meas_ratio = rows[1]["measured_median"] / rows[0]["measured_median"]
    report.say(f"2 stages / 1: predicted {pred_ratio:.3f}, measured {meas_ratio:.3f}")
    within = all(abs(r["ratio"] - 1) <= TARGET for r in rows)
    report.say(f"within {TARGET:.0%} of the prediction: {'yes' if within else 'no'}")
    report.write({"settings": vars(args) | {"dtype": dtype_label(args.dtype), "threads": threads},
                  "measured_here": [vars(before), vars(after)], "rows": rows})


if __name__ == "__main__":
    main()
