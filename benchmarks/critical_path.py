"""Where one stream's inter-token time goes: the stage's compute per step against the gap between tokens the client
sees, through a real `stagemesh up --stages N`. The difference is the critical path outside compute (gateway
scheduler, ZeroMQ hops, SSE), which issue 14 holds to <= 1.5 ms per token at one stream; the hops are split out
from the stages' and the gateway's own hop-latency histograms (send time in the header, receipt at decode).

    python -m benchmarks.critical_path [--stages 1] [--tokens 128] [--runs 3] [--prompt-tokens 64] [--dtype D]
                                       [--out DIR] [-- extra up flags]

Each run streams one /v1/completions request (ignore_eos, greedy) and reads every stage's busy seconds and
micro-batch count from /metrics before and after, so compute per step is the stage's own measurement. The first
token's time is split the same way: a random prompt of --prompt-tokens tokens (the comparison benchmark's 64) with
max_tokens 1, TTFT against the stages' compute of that one prefill micro-batch. Writes critical_path.json and
critical_path.md (what it printed) into --out (default: a new benchmarks/results/<date>-critical_path)."""

from __future__ import annotations

import argparse
import asyncio
import statistics

import aiohttp

from loadtest.client import send_sse
from loadtest.datasets import random_requests
from services.testing.harness import Report, add_dtype_arg, add_out_arg, dtype_label, running_up, scrape
from shared.runtime.model_files import ModelFiles

STAGE = ["stagemesh_stage_busy_seconds_total", "stagemesh_stage_microbatches_total",
         "stagemesh_stage_hop_latency_seconds_sum", "stagemesh_stage_hop_latency_seconds_count"]
GATEWAY = ["stagemesh_gateway_result_hop_latency_seconds_sum", "stagemesh_gateway_result_hop_latency_seconds_count"]


def per_event(before: list[float], after: list[float]) -> list[float]:
    """(sum, count) counter pairs -> mean per event over the run."""
    deltas = [b - a for a, b in zip(before, after)]
    return [deltas[i] / max(1.0, deltas[i + 1]) for i in range(0, len(deltas), 2)]


async def one_run(url: str, stage_urls: list[str], tokens: int,
                  prompt: str = "The history of the printing press") -> dict:
    before = [scrape(u, STAGE) for u in stage_urls], scrape(url, GATEWAY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        res = await send_sse(s, url, "openai", "smollm2", prompt, 0, tokens, ignore_eos=True, temperature=0.0)
    after = [scrape(u, STAGE) for u in stage_urls], scrape(url, GATEWAY)
    if not res.success:
        raise RuntimeError(res.error)
    stages = [per_event(b, a) for b, a in zip(before[0], after[0])]  # [compute per micro-batch, hop into the stage]
    per_stage = [s[0] for s in stages]
    hops = [s[1] for s in stages] + per_event(before[1], after[1])  # every hop of a token's round trip, in order
    itl = statistics.mean(res.itl) if res.itl else 0.0
    compute = sum(per_stage)  # one stream: the stages run one after another on every step
    return {"itl_ms": itl * 1e3, "compute_ms": compute * 1e3, "overhead_ms": (itl - compute) * 1e3,
            "per_stage_ms": [x * 1e3 for x in per_stage], "ttft_ms": (res.ttft or res.latency) * 1e3, "hops_ms": [h * 1e3 for h in hops]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of the first-token split")
    add_dtype_arg(p)
    add_out_arg(p, "critical_path")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    report = Report("critical_path", args.out)
    with running_up(args.stages, *args.extra, dtype=args.dtype) as gw:
        compiled = gw.wait_compiled()  # running_up waited already: each stage's compiled_decode entry
        stage_urls = gw.stage_urls()
        asyncio.run(one_run(gw.url, stage_urls, 8))  # warm-up
        runs = [asyncio.run(one_run(gw.url, stage_urls, args.tokens)) for _ in range(args.runs)]
        tokenizer = ModelFiles.open("smollm2").tokenizer
        prompts = random_requests(tokenizer, args.runs, args.prompt_tokens, 1, 0.0, seed=1)
        firsts = [asyncio.run(one_run(gw.url, stage_urls, 1, r.prompt)) for r in prompts]
    report.say(f"critical path: up --stages {args.stages} ({dtype_label(args.dtype)}) {' '.join(args.extra)}, 1 stream, "
               f"{args.tokens} tokens, {args.runs} runs; compiled decode step: {[c['state'] for c in compiled]}")
    for r in runs:
        stages = " + ".join(f"{x:.2f}" for x in r["per_stage_ms"])
        report.say(f"  client ITL {r['itl_ms']:6.2f} ms = stage compute {r['compute_ms']:6.2f} ms ({stages}) "
                   f"+ outside compute {r['overhead_ms']:5.2f} ms   (TTFT {r['ttft_ms']:.0f} ms)")
        hops = r["hops_ms"]
        report.say(f"    of which ZeroMQ hops (send to receipt) {' + '.join(f'{h:.2f}' for h in hops)} = {sum(hops):.2f} ms; "
                   f"the rest, {r['overhead_ms'] - sum(hops):.2f} ms, is the gateway's turnaround and the stages' loops")
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    report.say(f"median: ITL {med('itl_ms'):.2f} ms, compute {med('compute_ms'):.2f} ms, outside compute "
               f"{med('overhead_ms'):.2f} ms per token ({med('overhead_ms') / med('itl_ms'):.1%} of the gap)")
    report.say(f"first token of a {args.prompt_tokens}-token prompt (max_tokens 1, {args.runs} random prompts):")
    for r in firsts:  # one micro-batch: the whole prompt in one chunk, as prefill_chunk (128) >= the prompt
        stages = " + ".join(f"{x:.2f}" for x in r["per_stage_ms"])
        report.say(f"  TTFT {r['ttft_ms']:6.2f} ms = prefill compute {r['compute_ms']:6.2f} ms ({stages}) "
                   f"+ outside compute {r['ttft_ms'] - r['compute_ms']:5.2f} ms")
    report.write({"settings": vars(args) | {"dtype": dtype_label(args.dtype)}, "compiled_decode": compiled,
                  "runs": runs, "first_tokens": firsts})


if __name__ == "__main__":
    main()
