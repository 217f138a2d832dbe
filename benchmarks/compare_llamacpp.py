"""Side by side, in one run: llama.cpp's own C++ `llama-server` (continuous batching, 32 parallel slots) against
`stagemesh up --stages 1` and `--stages 2`, same model file, same machine, same load generator (`stagemesh bench`,
random prompts, --ignore-eos, temperature 0.7), at concurrency 1 / 4 / 16 / 32.

    make llama-server                                   # builds it once into ~/.cache/stagemesh (~8 min)
    python -m benchmarks.compare_llamacpp [--out benchmarks/results/DATE] [--concurrency 1,4,16,32] [-- up flags]

Writes comparison.json, comparison.md (the table, with ratios to llama-server) and comparison.png (output
tokens/s and p99 TTFT against concurrency) into --out."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from services.launch import free_port, start_up
from shared.device import cpu_has_fast_bf16, default_dtype_name
from shared.model_registry import resolve_model

LLAMA_SERVER = os.path.expanduser("~/.cache/stagemesh/llama-server/bin/llama-server")


def bench(url: str, label: str, concurrency: int, out: str, args) -> dict:
    result = os.path.join(out, f"{label.replace(' ', '_')}-c{concurrency}.json")
    cmd = [sys.executable, "-m", "services.cli", "bench", "--base-url", url, "--label", label,
           "--max-concurrency", str(concurrency), "--num-prompts", str(max(args.min_prompts, 2 * concurrency)),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
           "--temperature", "0.7", "--save-result", result, "--quiet", "--warmup", "2"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.load(open(result))  # vLLM-named metrics at the top level


def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def run_llama_server(levels: list[int], out: str, args) -> dict:
    port = free_port()
    # -c is shared by the 32 slots: 8192 gives each 256 tokens, room for 64 in + 64 out (4096 would give 128)
    cmd = [args.llama_server, "-m", resolve_model("smollm2"), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(os.cpu_count()), "-np", "32", "-cb", "-c", "8192", "--no-webui"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        return {c: bench(f"http://127.0.0.1:{port}", "llama-server", c, out, args) for c in levels}
    finally:
        server.terminate()
        server.wait(30)


def run_stagemesh(stages: int, levels: list[int], out: str, args) -> dict:
    with tempfile.TemporaryDirectory() as logs:
        gw = start_up(stages, args.dtype, logs, *args.extra)
        try:
            print(f"stagemesh {stages} stage(s): compiled decode {gw.wait_compiled()}", flush=True)
            return {c: bench(gw.url, f"stagemesh {stages} stage{'s' * (stages > 1)}", c, out, args) for c in levels}
        finally:
            gw.stop()


def table(results: dict[str, dict], levels: list[int]) -> str:
    ref = results["llama-server"]
    rows = ["| server | concurrency | output tok/s | × llama-server | mean TTFT | p99 TTFT | mean ITL | failed |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, by_level in results.items():
        for c in levels:
            m = by_level[c]
            ratio = m["output_throughput"] / ref[c]["output_throughput"]
            rows.append(f"| {name} | {c} | {m['output_throughput']:.1f} | {ratio:.2f}× | {m['mean_ttft_ms']:.0f} ms | "
                        f"{m['p99_ttft_ms']:.0f} ms | {m['mean_itl_ms']:.1f} ms | {m['failed']} |")
    return "\n".join(rows)


def plot(results: dict[str, dict], levels: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_level in results.items():
        a.plot(levels, [by_level[c]["output_throughput"] for c in levels], marker="o", label=name)
        b.plot(levels, [by_level[c]["p99_ttft_ms"] for c in levels], marker="o", label=name)
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
    p.add_argument("--out", default="bench-output/compare")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--min-prompts", type=int, default=8, help="requests per level at least (else 2 x concurrency)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default=None, help="stagemesh --dtype (default: up's default)")
    p.add_argument("--llama-server", default=LLAMA_SERVER, help="path of llama.cpp's llama-server (make llama-server)")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    if not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server}: run `make llama-server` first")
    levels = [int(x) for x in args.concurrency.split(",")]
    os.makedirs(args.out, exist_ok=True)
    results = {"llama-server": run_llama_server(levels, args.out, args)}
    for stages in (1, 2):
        results[f"stagemesh up --stages {stages}"] = run_stagemesh(stages, levels, args.out, args)
    md = table(results, levels)
    header = (f"SmolLM2-135M-Instruct Q4_1, {os.cpu_count()} CPU cores, {args.input_len} prompt tokens, "
              f"{args.output_len} output tokens (ignore_eos), temperature 0.7; llama-server -t {os.cpu_count()} -np 32 "
              f"-cb -c 8192; stagemesh up {' '.join(([f'--dtype {args.dtype}'] if args.dtype else []) + args.extra) or '(defaults)'}"
              f" (activations {args.dtype or default_dtype_name()}, {'native' if cpu_has_fast_bf16() else 'no native'} "
              "bf16 on this CPU)")
    print(header + "\n\n" + md)
    with open(os.path.join(args.out, "comparison.md"), "w") as f:
        f.write(header + "\n\n" + md + "\n")
    with open(os.path.join(args.out, "comparison.json"), "w") as f:
        json.dump({"settings": header, "results": {k: {str(c): m for c, m in v.items()} for k, v in results.items()}},
                  f, indent=1)
    plot(results, levels, os.path.join(args.out, "comparison.png"))


if __name__ == "__main__":
    main()
