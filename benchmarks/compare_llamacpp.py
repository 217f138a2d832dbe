"""Side by side: `stagemesh up --stages 2` against llama-cpp-python's own OpenAI-compatible server, same model
file, same machine, same load generator (`stagemesh bench`), concurrency 1, 4 and 16.

    python -m benchmarks.compare_llamacpp [--out bench-output/compare] [--input-len 64] [--output-len 64]

Needs `pip install 'llama-cpp-python[server]'` (make install-reference). Writes one sweep JSON + PNGs per server
and prints output tokens/s, mean and p99 TTFT and ITL per concurrency."""

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
from shared.model_registry import resolve_model


def bench(url: str, label: str, out: str, args) -> dict:
    os.makedirs(out, exist_ok=True)
    result = os.path.join(out, "sweep.json")
    cmd = [sys.executable, "-m", "services.cli", "bench", "--base-url", url, "--label", label,
           "--sweep-concurrency", args.concurrency, "--num-prompts", str(args.num_prompts), "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0.7",
           "--save-result", result, "--plot", out, "--quiet", "--warmup", "2"]
    subprocess.run(cmd, check=True)
    return json.load(open(result))


def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-output/compare")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    sweeps = {}
    with tempfile.TemporaryDirectory() as logs:
        gw = start_up(2, args.dtype, logs)
        try:
            sweeps["stagemesh"] = bench(gw.url, f"stagemesh up --stages 2 ({args.dtype})", f"{args.out}/stagemesh", args)
        finally:
            gw.stop()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", resolve_model("smollm2"),
                               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
                               "--n_threads", str(os.cpu_count()),
                               # by default a new request interrupts the running stream (outputs get cut short);
                               # queueing instead is the fair comparison
                               "--interrupt_requests", "False"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models")
        sweeps["llama.cpp"] = bench(f"http://127.0.0.1:{port}", "llama-cpp-python server", f"{args.out}/llamacpp", args)
    finally:
        server.terminate()
        server.wait(30)
    print(f"\nSmolLM2-135M Q4_1, {os.cpu_count()} cores, {args.input_len} in / {args.output_len} out tokens, "
          f"{args.num_prompts} requests per level")
    print(f"{'server':<12} {'conc':>4} {'out tok/s':>10} {'mean TTFT':>10} {'p99 TTFT':>9} {'mean ITL':>9} {'p99 ITL':>8}")
    for name, sweep in sweeps.items():
        for pt in sweep["points"]:
            print(f"{name:<12} {pt['sweep_value']:>4g} {pt['output_throughput']:>10.1f} {pt['mean_ttft_ms']:>8.0f}ms "
                  f"{pt['p99_ttft_ms']:>7.0f}ms {pt['mean_itl_ms']:>7.1f}ms {pt['p99_itl_ms']:>6.1f}ms "
                  f"({pt['total_output_tokens']} tokens, {pt['failed']} failed)")
    with open(f"{args.out}/comparison.json", "w") as f:
        json.dump(sweeps, f, indent=1)


if __name__ == "__main__":
    main()
