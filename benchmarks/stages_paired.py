"""One stream through N stages against one stage on the same host, measured in pairs: the ratio issue 29 targets
(2 stages >= 0.9x of 1 stage at one stream), with an interval narrow enough to tell a change from this VM's drift.

    python -m benchmarks.stages_paired [--stages 2] [--pairs 24] [--tokens 256] [--prompt-tokens 64] [--dtype D]
                                       [--out DIR] [-- extra up flags]

`stagemesh up --stages 1` and `--stages N` run at once (an idle one uses under 1 % of a core) and take turns: each
pair streams one request (a fresh random prompt, the same for both, greedy, ignore_eos) through each, the order
alternating (1 N, N 1, ...). A pair's two requests run within seconds of each other, so each pair's ratio is fair
even while the machine's speed drifts by tens of percent over minutes (benchmarks.compare_llamacpp interleaves
rounds of tens of seconds instead). A request's speed is its decode rate, 1 / its mean inter-token time; the first
token (prefill) is left out.

Prints every pair's ratio, their median and quartiles, and how many pairs reach 0.9. Writes stages_paired.json,
stages_paired.md (what it printed) and stages_paired.png (the ratio of every pair, in order) into --out (default: a
new benchmarks/results/<date>-stages_paired)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics

import aiohttp

from loadtest.client import send_sse
from loadtest.datasets import random_requests
from services.testing.harness import Report, add_dtype_arg, add_out_arg, dtype_label, ups_in_turn
from shared.runtime.model_files import ModelFiles

TARGET = 0.9  # issue 29: N stages on one host at one stream, against 1 stage


async def decode_rate(url: str, prompt: str, tokens: int) -> float:
    """Tokens a second after the first, of one greedy request streamed from `url`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        res = await send_sse(s, url, "openai", "smollm2", prompt, 0, tokens, ignore_eos=True, temperature=0.0)
    if not res.success or len(res.itl) < tokens // 2:
        raise RuntimeError(f"{url}: {res.error or f'{len(res.itl) + 1} tokens streamed of {tokens}'}")
    return 1.0 / statistics.mean(res.itl)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def plot(ratios: list[float], stages: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, len(ratios) + 1), ratios, marker="o", label="each pair")
    ax.axhline(statistics.median(ratios), color="tab:green", label="median")
    ax.axhline(TARGET, color="tab:red", linestyle="--", label=f"target {TARGET}")
    ax.set_xlabel("pair, in the order run")
    ax.set_ylabel(f"{stages} stages / 1 stage, decode tok/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="the stage count compared with 1 stage")
    p.add_argument("--pairs", type=int, default=24)
    p.add_argument("--tokens", type=int, default=256, help="output tokens of each request")
    p.add_argument("--prompt-tokens", type=int, default=64)
    add_dtype_arg(p)
    add_out_arg(p, "stages_paired")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    if args.stages < 2 or args.pairs < 1 or args.tokens < 8:
        p.error("--stages must be >= 2, --pairs >= 1 and --tokens >= 8")
    report = Report("stages_paired", args.out)
    prompts = random_requests(ModelFiles.open("smollm2").tokenizer, args.pairs + 1, args.prompt_tokens, 1, 0.0, seed=7)
    with contextlib.ExitStack() as stack:
        urls = ups_in_turn(stack, [1, args.stages], "smollm2", args.dtype, args.extra)
        for url in urls.values():  # warm-up, outside the pairs
            asyncio.run(decode_rate(url, prompts[-1].prompt, 16))
        pairs = []
        for i, req in enumerate(prompts[:-1]):
            order = [1, args.stages] if i % 2 == 0 else [args.stages, 1]
            rate = {n: asyncio.run(decode_rate(urls[n], req.prompt, args.tokens)) for n in order}
            pairs.append({"one_stage": rate[1], "stages": rate[args.stages], "ratio": rate[args.stages] / rate[1]})
            print(f"  pair {i + 1:>2}: 1 stage {rate[1]:6.1f}, {args.stages} stages {rate[args.stages]:6.1f} tok/s, "
                  f"ratio {pairs[-1]['ratio']:.3f}", flush=True)
    ratios = [x["ratio"] for x in pairs]
    q1, med, q3 = quartiles(ratios)
    one = statistics.median(x["one_stage"] for x in pairs)
    many = statistics.median(x["stages"] for x in pairs)
    report.say(f"one stream, {args.tokens} tokens a request, {args.pairs} pairs, up --stages 1 against --stages "
               f"{args.stages} ({dtype_label(args.dtype)}) {' '.join(args.extra)}")
    report.say("pairs' ratios, in order: " + ", ".join(f"{r:.3f}" for r in ratios))
    report.say(f"{args.stages} stages / 1 stage: median {med:.3f} (quartiles {q1:.3f} - {q3:.3f}); "
               f"{sum(r >= TARGET for r in ratios)} of {len(ratios)} pairs at >= {TARGET}")
    report.say(f"decode tok/s, medians: 1 stage {one:.1f}, {args.stages} stages {many:.1f}")
    out = report.write({"settings": vars(args) | {"dtype": dtype_label(args.dtype)}, "pairs": pairs,
                        "median": med, "quartiles": [q1, q3]})
    plot(ratios, args.stages, os.path.join(out, "stages_paired.png"))


if __name__ == "__main__":
    main()
