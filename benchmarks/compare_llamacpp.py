"""Side by side, in one run: llama.cpp's own C++ `llama-server` (continuous batching, 32 parallel slots) against
`stagemesh up --stages 1` and `--stages 2`, same model file, same machine, same load generator (`stagemesh bench`,
random prompts, fresh for every level and round (prompt_seed), --ignore-eos, temperature 0.7), at concurrency 1 / 4 /
16 / 32.

    make llama-server                                   # builds it once into ~/.cache/stagemesh (~8 min)
    python -m benchmarks.compare_llamacpp [--out DIR] [--concurrency 1,4,16,32] [--rounds 2] [--dtype D]
        [--model ALIAS_OR_GGUF] [--stages 1,2] [-- up flags]

The three servers run at once (an idle `stagemesh up` uses under 1 % of a core) and are measured interleaved: at
each concurrency level, --rounds rounds, each round benching every server once, the order reversed every other round
(A B C, C B A, ...). This shared machine's speed drifts by tens of percent over minutes, so a ratio is only fair
between runs minutes apart at most; each table row is the mean over rounds, and the ratio column also gives every
round's own ratio (the servers it divides ran within a minute of each other).

Writes comparison.json (every round's metrics too), comparison.md (the table, with ratios to llama-server) and
comparison.png (output tokens/s and p99 TTFT against concurrency) into --out (default: a new
benchmarks/results/<date>-compare)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from services.testing.harness import (
    LLAMA_SERVER,
    add_dtype_arg,
    add_out_arg,
    dtype_label,
    measure_servers,
    results_dir,
    running_llama_server,
    ups_in_turn,
    write_results,
)
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model
from shared.models.device import cpu_has_fast_bf16

LLAMA_SLOTS = 32  # llama-server's parallel slots (-np): as many as the highest default concurrency


def llama_server_context(args) -> int:
    """llama-server's -c: its 32 slots share it, and a slot stops generating where its share ends (it answered 192 of
    512 tokens with 8192, 256 a slot, and so looked faster per token), so each slot gets room for the prompt, the
    answer and the chat template's few tokens, and at least 256."""
    return LLAMA_SLOTS * max(256, args.input_len + args.output_len + 64)


def combine(rounds: list[dict]) -> dict:
    """One server's rounds at one level -> the row's figures: means over rounds (failed: the sum)."""
    def mean(key: str) -> float:
        return sum(m[key] for m in rounds) / len(rounds)

    return {"output_throughput": mean("output_throughput"), "mean_ttft_ms": mean("mean_ttft_ms"),
            "p99_ttft_ms": mean("p99_ttft_ms"), "mean_itl_ms": mean("mean_itl_ms"),
            "failed": sum(m["failed"] for m in rounds)}


def table(runs: dict[str, dict[int, list[dict]]], levels: list[int]) -> str:
    ref = runs["llama-server"]
    rows = ["| server | concurrency | output tok/s | × llama-server (each round) | mean TTFT | p99 TTFT | mean ITL | failed |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, by_level in runs.items():
        for c in levels:
            m, base = combine(by_level[c]), combine(ref[c])
            each = ", ".join(f"{a['output_throughput'] / b['output_throughput']:.2f}" for a, b in zip(by_level[c], ref[c]))
            ratio = f"{m['output_throughput'] / base['output_throughput']:.2f}×" + (f" ({each})" if len(ref[c]) > 1 else "")
            rows.append(f"| {name} | {c} | {m['output_throughput']:.1f} | {ratio} | {m['mean_ttft_ms']:.0f} ms | "
                        f"{m['p99_ttft_ms']:.0f} ms | {m['mean_itl_ms']:.1f} ms | {m['failed']} |")
    return "\n".join(rows)


def plot(runs: dict[str, dict[int, list[dict]]], levels: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_level in runs.items():
        rows = [combine(by_level[c]) for c in levels]
        a.plot(levels, [m["output_throughput"] for m in rows], marker="o", label=name)
        b.plot(levels, [m["p99_ttft_ms"] for m in rows], marker="o", label=name)
    for ax, title in ((a, "output tokens/s"), (b, "p99 TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arg(p, "compare")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--min-prompts", type=int, default=8, help="requests per level at least (else 2 x concurrency)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per level, the servers interleaved in each")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    add_dtype_arg(p, "stagemesh's")
    p.add_argument("--model", default="smollm2", help="alias or GGUF path, served by all of them (default smollm2)")
    p.add_argument("--stages", default="1,2", help="stagemesh meshes to run beside llama-server (default 1,2)")
    p.add_argument("--llama-server", default=LLAMA_SERVER, help="path of llama.cpp's llama-server (make llama-server)")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    if not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server}: run `make llama-server` first")
    levels = [int(x) for x in args.concurrency.split(",")]
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    out = results_dir(args.out, "compare")
    with contextlib.ExitStack() as stack:
        servers = {"llama-server": stack.enter_context(running_llama_server(
            args.model, args.llama_server, slots=LLAMA_SLOTS, context=llama_server_context(args)))}
        for stages, url in ups_in_turn(stack, [int(x) for x in args.stages.split(",")], args.model, args.dtype,
                                       args.extra).items():
            servers[f"stagemesh up --stages {stages}"] = url
        runs = measure_servers(servers, levels, out, args)
    md = table(runs, levels)
    header = (f"{GgufLoader(resolve_model(args.model)).model_name} ({os.path.basename(resolve_model(args.model))}), "
              f"{os.cpu_count()} CPU cores, {args.input_len} prompt tokens, "
              f"{args.output_len} output tokens (ignore_eos), temperature 0.7; llama-server -t {os.cpu_count()} "
              f"-np {LLAMA_SLOTS} -cb -c {llama_server_context(args)}; stagemesh up {' '.join(([f'--dtype {args.dtype}'] if args.dtype else []) + args.extra) or '(defaults)'}"
              f" (activations {dtype_label(args.dtype)}, {'native' if cpu_has_fast_bf16() else 'no native'} "
              f"bf16 on this CPU); {args.rounds} round(s) per level, the servers interleaved")
    print(header + "\n\n" + md)
    write_results(out, "comparison", {
        "settings": header, "results": {k: {str(c): combine(r) for c, r in v.items()} for k, v in runs.items()},
        "rounds": {k: {str(c): r for c, r in v.items()} for k, v in runs.items()}}, header + "\n\n" + md)
    plot(runs, levels, os.path.join(out, "comparison.png"))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
