"""One-stream decode against the memory roofline, in one run (shared/runtime/roofline.py): this host's read bandwidth
(a STREAM triad, every core, measured before and after the servers), the bytes a token reads (the file's weights as the
GGUF stores them), and the one-stream decode speed of llama.cpp's llama-server and `stagemesh up --stages 1` on the
same file, measured side by side (`stagemesh bench`, one stream, --ignore-eos; decode tok/s = a request's tokens
after its first over its time after the first, mean end-to-end latency less mean TTFT, so the prefill is left out --
not 1000 / mean inter-token latency: llama-server's stream sometimes carries several tokens in one event, which that
mean counts as one long gap). Each server's fraction = its decode tok/s x bytes a token /
bandwidth: 1.0 would read every byte of the file at the triad's speed every token.

    make llama-server                                  # builds it once into ~/.cache/stagemesh (~8 min)
    python -m benchmarks.roofline [--models smollm2,llama3.2-1b,llama3.2-3b,llama3.1-8b] [--preset Q4_K_M]
        [--output-len 64] [--rounds 2] [--out DIR] [-- up flags]

A model is an alias, a GGUF path, or a model-shaped file's name (services/testing/shaped_gguf.SHAPES: real tensor
layouts, seeded random weights, quantized to --preset by llama.cpp; built once into a cache: minutes and GBs for the
8B). Writes roofline.json, roofline.md and roofline.png (each server's fraction per model) into --out (default: a new
benchmarks/results/<date>-roofline)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from types import SimpleNamespace

from services.testing.harness import (
    LLAMA_SERVER,
    add_dtype_arg,
    add_out_arg,
    dtype_label,
    measure_servers,
    model_file,
    results_dir,
    running_llama_server,
    ups_in_turn,
    write_results,
)
from services.testing.shaped_gguf import SHAPES
from shared.files.gguf_loader import GgufLoader
from shared.runtime.plan import ModelFacts
from shared.runtime.roofline import Roofline, token_bytes, triad_bandwidth


def decode_tokens_per_s(m: dict) -> float:
    """One stream's decode speed in one round's bench result: the tokens after each request's first over the time
    after its first token (mean end-to-end latency less mean TTFT, ms)."""
    return (m["total_output_tokens"] / m["completed"] - 1) / ((m["mean_e2el_ms"] - m["mean_ttft_ms"]) / 1e3)


def one_model(path: str, args, out: str) -> dict:
    facts = ModelFacts.from_gguf(GgufLoader(path), kv_itemsize=4)
    per_token = token_bytes(facts)
    before = triad_bandwidth()
    bench_args = SimpleNamespace(rounds=args.rounds, min_prompts=args.prompts, input_len=args.input_len,
                                 output_len=args.output_len)
    with contextlib.ExitStack() as stack:
        servers = {"llama-server": stack.enter_context(running_llama_server(
            path, args.llama_server, slots=1, context=args.input_len + args.output_len + 256))}
        servers["stagemesh up --stages 1"] = ups_in_turn(stack, [1], path, args.dtype, args.extra)[1]
        bench_out = os.path.join(out, os.path.basename(path).removesuffix(".gguf"))
        os.makedirs(bench_out, exist_ok=True)
        runs = measure_servers(servers, [1], bench_out, bench_args)
    after = triad_bandwidth()
    bandwidth = (before + after) / 2

    roof = Roofline(bandwidth, per_token)
    servers = {}
    for name, by_level in runs.items():
        each = [decode_tokens_per_s(m) for m in by_level[1]]
        speed = sum(each) / len(each)
        servers[name] = {"decode_tokens_per_s": round(speed, 2), "fraction": round(roof.fraction(speed), 4),
                         "decode_tokens_per_s_each_round": [round(x, 2) for x in each]}
    return {"model": facts.name, "file": os.path.basename(path), "bytes_per_token": per_token,
            "triad_bytes_per_s": {"before": round(before), "after": round(after)},
            "roofline_tokens_per_s": round(roof.tokens_per_s, 2), "servers": servers}


def table(results: list[dict]) -> str:
    rows = ["| model | MiB a token | triad GB/s (before, after) | roofline tok/s | server | decode tok/s | "
            "fraction of the roofline | × llama-server |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        base = r["servers"]["llama-server"]["decode_tokens_per_s"]
        for name, s in r["servers"].items():
            triad = r["triad_bytes_per_s"]
            rows.append(f"| {r['model']} ({r['file']}) | {r['bytes_per_token'] / 2**20:.0f} | "
                        f"{triad['before'] / 1e9:.1f}, {triad['after'] / 1e9:.1f} | {r['roofline_tokens_per_s']:.1f} | "
                        f"{name} | {s['decode_tokens_per_s']:.1f} | {100 * s['fraction']:.0f} % | "
                        f"{s['decode_tokens_per_s'] / base:.2f}× |")
    return "\n".join(rows)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results[0]["servers"])
    fig, ax = plt.subplots(figsize=(max(5, 2 + 1.6 * len(results)), 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([i + k * width for i in range(len(results))], [100 * r["servers"][name]["fraction"] for r in results],
               width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(results))], [r["model"] for r in results])
    ax.axhline(100, color="k", lw=0.8)
    ax.set_ylabel("one-stream decode, % of bandwidth / bytes a token")
    ax.set_title("one stream against the memory roofline")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arg(p, "roofline")
    p.add_argument("--models", default="smollm2", help="comma-separated aliases, GGUF paths or shaped-file names "
                                                       f"({', '.join(SHAPES)}); default smollm2")
    p.add_argument("--preset", default="Q4_K_M", help="llama.cpp quantization of the shaped files (default Q4_K_M)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the servers interleaved in each (default 2)")
    p.add_argument("--prompts", type=int, default=4, help="requests per round, one at a time (default 4)")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    add_dtype_arg(p, "stagemesh's")
    p.add_argument("--llama-server", default=LLAMA_SERVER, help="path of llama.cpp's llama-server (make llama-server)")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    if not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server}: run `make llama-server` first")
    if args.rounds < 1 or args.prompts < 1:
        sys.exit("--rounds and --prompts must be at least 1")
    out = results_dir(args.out, "roofline")
    results = []
    for name in args.models.split(","):
        results.append(one_model(model_file(name, args.preset), args, out))
        print(table(results[-1:]), flush=True)
    header = (f"{os.cpu_count()} CPU cores; one stream, {args.input_len} prompt tokens, {args.output_len} output "
              f"tokens (ignore_eos), {args.rounds} round(s) of {args.prompts} requests, the servers interleaved; "
              f"decode tok/s = (tokens - 1) / (end-to-end - TTFT); llama-server -t {os.cpu_count()} -np 1; stagemesh up --stages 1 "
              f"{' '.join(args.extra) or '(defaults)'} (activations {dtype_label(args.dtype)}); the bandwidth is the "
              "mean of a STREAM triad (3 x 256 MiB float32, every core) before and after each model's servers")
    md = header + "\n\n" + table(results)
    print(md)
    write_results(out, "roofline", {"settings": header, "results": results}, md)
    plot(results, os.path.join(out, "roofline.png"))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
