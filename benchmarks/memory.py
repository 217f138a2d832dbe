"""What each stage of `stagemesh up --stages N` holds against its share of the GGUF file, per weights mode, and what
that costs in speed: per stage the weights it holds (/info), its anonymous resident memory (RssAnon: without the
file's pages, which the OS reclaims), its peak resident set while loading (VmHWM) and its share of the file; per mesh
the time from start to ready, the time to first token of a prompt (prefill) and the time per output token (decode)
at one stream.

    python -m benchmarks.memory [--stages 2] [--modes auto,lean] [--dtype D] [--out DIR] MODEL [MODEL ...]

MODEL: an alias or a GGUF path (e.g. the presets tests/test_real_files.py builds into ~/.cache/stagemesh/quantized).
Writes memory.json and memory.md into --out (default: a new benchmarks/results/<date>-memory)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from services.testing.harness import (
    add_dtype_arg,
    add_out_arg,
    anon_mb,
    dtype_label,
    peak_rss_mb,
    results_dir,
    rss_mb,
    running_up,
    write_results,
)
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model

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
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as logs, running_up(args.stages, "--model", path, "--weights", mode,
                                                           "--compile-decode", "off", dtype=args.dtype,
                                                           compiled=False, log_dir=logs) as gw:
        ready_s = time.monotonic() - t0
        stages = []
        pids = gw.stage_pids()
        for i in range(args.stages):
            info = gw.stage_info(i)
            mem = info.weights["memory"]
            stages.append({"layers": list(info.layers), "file_mib": mem["file_bytes"] / MIB,
                           "weights_mib": mem["weight_bytes"] / MIB, "ratio": mem["weights_per_file_byte"],
                           "kv_mib": mem["kv_bytes"] / MIB, "prefill_copy": mem["prefill_copy"],
                           "rss_mib": rss_mb(pids[i]), "anon_mib": anon_mb(pids[i]), "peak_mib": peak_rss_mb(pids[i])})
        speed = one_stream(gw.url, args, logs)
        for i, s in enumerate(stages):
            s["anon_after_mib"] = anon_mb(pids[i])  # with the K/V of the requests served
    return {"model": GgufLoader(path).model_name, "file": os.path.basename(path), "mode": mode,
            "dtype": dtype_label(args.dtype), "stages": stages, "file_mib": os.path.getsize(path) / MIB,
            "ready_s": ready_s, "mean_ttft_ms": speed["mean_ttft_ms"], "mean_itl_ms": speed["mean_itl_ms"]}


def table(rows: list[dict], args) -> str:
    out = [f"`stagemesh up --stages {args.stages}`, {dtype_label(args.dtype)}, eager decode, one stream: "
           f"{args.input_len}-token prompts, {args.output_len} output tokens; per stage: weights held / the GGUF bytes "
           "of its layers (x); anonymous memory when ready (and after the requests: with their K/V); peak RSS while "
           "loading (VmHWM, the file's pages included)", "",
           "| file | weights | per stage: weights / file share (x) | anonymous (after requests) | peak | ready | TTFT | ITL |",
           "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        per_stage = "; ".join(f"{s['weights_mib']:.0f} / {s['file_mib']:.0f} MiB ({s['ratio']:.2f}x)" for s in r["stages"])
        anon = "; ".join(f"{s['anon_mib']:.0f} ({s['anon_after_mib']:.0f}) MiB" for s in r["stages"])
        peak = "; ".join(f"{s['peak_mib']:.0f} MiB" for s in r["stages"])
        out.append(f"| {r['file']} ({r['file_mib']:.0f} MiB) | {r['mode']} | {per_stage} | {anon} | {peak} | "
                   f"{r['ready_s']:.0f} s | {r['mean_ttft_ms']:.0f} ms | {r['mean_itl_ms']:.1f} ms |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--modes", default="auto,lean")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    add_dtype_arg(p)
    add_out_arg(p, "memory")
    args = p.parse_args()
    rows = []
    for model in args.models:
        for mode in args.modes.split(","):
            rows.append(measure(model, mode, args))
            print(json.dumps(rows[-1]), flush=True)
    md = table(rows, args)
    print(md)
    write_results(results_dir(args.out, "memory"), "memory", rows, md)


if __name__ == "__main__":
    main()
