"""What each stage of `stagemesh up --stages N` holds against its share of the GGUF file, per weights mode, and what
that costs in speed: per stage the weights it holds (/info), its resident set (VmRSS) and its share of the file; per
mesh the time to first token of a prompt (prefill) and the time per output token (decode) at one stream.

    python -m benchmarks.memory [--stages 2] [--modes auto,lean] [--out DIR] MODEL [MODEL ...]

MODEL: an alias or a GGUF path (e.g. the presets tests/test_real_files.py builds into ~/.cache/stagemesh/quantized).
Writes memory.json and memory.md into --out."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.procs import children, rss_mb
from services.launch import start_up
from shared.gguf_loader import GgufLoader
from shared.model_registry import resolve_model

MIB = 2**20


def one_stream(url: str, args, out: str) -> dict:
    """Mean TTFT and ITL of `stagemesh bench` at one stream (prompts of --input-len tokens)."""
    result = os.path.join(out, "bench.json")
    subprocess.run([sys.executable, "-m", "services.cli", "bench", "--base-url", url, "--max-concurrency", "1",
                    "--num-prompts", str(args.prompts), "--input-len", str(args.input_len), "--output-len",
                    str(args.output_len), "--ignore-eos", "--save-result", result, "--quiet", "--warmup", "1"],
                   check=True, stdout=subprocess.DEVNULL)
    with open(result) as f:
        return json.load(f)


def measure(model: str, mode: str, args) -> dict:
    path = resolve_model(model)
    with tempfile.TemporaryDirectory() as logs:
        gw = start_up(args.stages, None, logs, "--model", path, "--weights", mode, "--compile-decode", "off")
        try:
            stages = []
            pids = children(gw.proc.pid)
            for i in range(args.stages):
                info = gw.stage_info(i)
                mem = info["weights"]["memory"]
                stages.append({"layers": info["layers"], "file_mib": mem["file_bytes"] / MIB,
                               "weights_mib": mem["weight_bytes"] / MIB, "ratio": mem["weights_per_file_byte"],
                               "kv_mib": mem["kv_bytes"] / MIB, "prefill_copy": mem["prefill_copy"]})
            rss = sorted(rss_mb(p) for p in pids)[-args.stages:]  # the stages (the largest children of up)
            speed = one_stream(gw.url, args, logs)
        finally:
            gw.stop()
    return {"model": GgufLoader(path).model_name, "file": os.path.basename(path), "mode": mode, "stages": stages,
            "rss_mib": rss, "mean_ttft_ms": speed["mean_ttft_ms"], "mean_itl_ms": speed["mean_itl_ms"]}


def table(rows: list[dict], args) -> str:
    out = [f"`stagemesh up --stages {args.stages}`, one stream: {args.input_len}-token prompts, {args.output_len} "
           "output tokens; per stage: weights held / the GGUF bytes of its layers (x), VmRSS", "",
           "| file | weights | per stage: weights / file share (x), RSS | TTFT | ITL |", "| --- | --- | --- | ---: | ---: |"]
    for r in rows:
        per_stage = "; ".join(f"{s['weights_mib']:.0f} / {s['file_mib']:.0f} MiB ({s['ratio']:.2f}x), {rss:.0f} MiB"
                              for s, rss in zip(r["stages"], r["rss_mib"]))
        out.append(f"| {r['file']} | {r['mode']} | {per_stage} | {r['mean_ttft_ms']:.0f} ms | {r['mean_itl_ms']:.1f} ms |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--modes", default="auto,lean")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--out", default="bench-output/memory")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for model in args.models:
        for mode in args.modes.split(","):
            rows.append(measure(model, mode, args))
            print(json.dumps(rows[-1]), flush=True)
    md = table(rows, args)
    print(md)
    with open(os.path.join(args.out, "memory.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
