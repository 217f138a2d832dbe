"""Prompt processing on AMX tiles against the integer-dot (VNNI) path and llama.cpp, in one run, on a CPU whose kernel
grants the tile state (shared/kernels/qdot.cpp's amx_mm; qdot.amx_why_not() says why not elsewhere).

Two parts, the machine otherwise idle:
1. The kernel curve: each of the file's distinct matrix shapes and types in layer 0 (Q4_K attn_q, ffn_gate, Q6_K
   ffn_down, ...), called with M rows (1 .. 512) on the integer-dot path (tile_rows 0) and on the tiles, best of 5,
   the two in turn: where the tiles start to win (qdot.AMX_MIN_ROWS).
2. The servers: `stagemesh up --stages 1` (AMX where it runs: the default), the same with STAGEMESH_AMX=off (the
   VNNI path) and llama.cpp's llama-server, one stream of fresh random --input-len-token prompts answered with one
   token (`stagemesh bench`, --ignore-eos): prompt tokens / mean end-to-end latency is the prompt processing speed a
   user sees (the gateway's prefill chunks, the HTTP and the tokenizer included; the one token comes from the prompt's
   last logits, no decode step; not the TTFT, which llama-server's stream of a one-token answer leaves at 0), the
   servers interleaved round by round.

    make llama-server                                  # builds it once into ~/.cache/stagemesh (~8 min)
    make llama-server-amx                              # optional: its AMX build, measured beside it
    python -m benchmarks.amx [--models llama3.2-1b,llama3.2-3b] [--preset Q4_K_M] [--input-len 512] [--rounds 3]
        [--out DIR] [-- up flags]

Writes amx.json, amx.md (both tables and the CPU they ran on) and amx.png (the kernel curves) into --out (default:
a new benchmarks/results/<date>-amx)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from types import SimpleNamespace

import torch

from services.testing.harness import (
    LLAMA_SERVER,
    add_out_arg,
    measure_servers,
    model_file,
    results_dir,
    running_llama_server,
    ups_in_turn,
    write_results,
)
from services.testing.shaped_gguf import SHAPES
from shared.cpu import cpu_flags
from shared.files.gguf_loader import GgufLoader
from shared.kernels import qdot
from shared.models.linear import QDOT_TYPES, QdotLinear

ROWS = (1, 8, 16, 24, 32, 48, 64, 128, 512)
AMX_LLAMA = "llama-server (AMX build)"
LLAMA_SERVER_AMX = os.path.expanduser("~/.cache/stagemesh/llama-server-amx/bin/llama-server")  # make llama-server-amx
MATRICES = ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_down")  # layer 0's (Q4_K_M: attn_v, ffn_down Q6_K)


def cpu_description() -> str:
    """The CPU as /proc/cpuinfo and lscpu's caches give it (a VM's model name is often generic)."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    amx = [f for f in ("amx_tile", "amx_bf16", "amx_int8") if f in cpu_flags()]
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}), "
            f"{os.cpu_count()} cores, {', '.join(amx) or 'no AMX'}")


def kernel_curve(path: str) -> list[dict]:
    """Per distinct (type, shape) of layer 0's MATRICES: ms at each of ROWS on both paths."""
    loader = GgufLoader(path)
    seen, curves = set(), []
    for name in MATRICES:
        raw = loader.raw(f"blk.0.{name}.weight")
        key = (raw.ggml_type, tuple(raw.shape))
        if key in seen or raw.ggml_type not in QDOT_TYPES or QDOT_TYPES[raw.ggml_type] not in qdot.AMX_OPS:
            continue
        seen.add(key)
        w = QdotLinear(raw)
        points = []
        for m in ROWS:
            x = torch.randn(m, raw.shape[1])
            paths = {"vnni": 0, "amx": max(1, m)}
            best = {p: float("inf") for p in paths}
            for rows in paths.values():
                qdot.mm(w.op, x, w.blocks, w.out_features, rows)
            for _ in range(5):
                for p, rows in paths.items():
                    t0 = time.perf_counter()
                    qdot.mm(w.op, x, w.blocks, w.out_features, rows)
                    best[p] = min(best[p], (time.perf_counter() - t0) * 1e3)
            points.append({"rows": m, "vnni_ms": round(best["vnni"], 3), "amx_ms": round(best["amx"], 3)})
        curves.append({"matrix": name, "type": raw.ggml_type, "shape": list(raw.shape), "points": points})
        print(f"  {name} {raw.ggml_type} {raw.shape}: " + ", ".join(
            f"{p['rows']} rows {p['vnni_ms'] / p['amx_ms']:.2f}x" for p in points), flush=True)
    return curves


def prefill_servers(path: str, args, out: str) -> dict:
    """Prompt tokens / mean end-to-end latency of each server, per round and their mean."""
    bench_args = SimpleNamespace(rounds=args.rounds, min_prompts=args.prompts, input_len=args.input_len, output_len=1)
    with contextlib.ExitStack() as stack:
        servers = {"llama-server": stack.enter_context(running_llama_server(
            path, args.llama_server, slots=1, context=args.input_len + 256))}
        if args.llama_server_amx:
            log = os.path.join(out, f"llama-server-amx-{os.path.basename(path).removesuffix('.gguf')}.log")
            servers[AMX_LLAMA] = stack.enter_context(running_llama_server(
                path, args.llama_server_amx, slots=1, context=args.input_len + 256, log_path=log))
        servers["stagemesh (AMX)"] = ups_in_turn(stack, [1], path, None, args.extra)[1]
        os.environ[qdot.AMX_ENV] = "off"  # the next server's stages inherit it
        try:
            with contextlib.ExitStack() as inner:
                servers["stagemesh (VNNI, STAGEMESH_AMX=off)"] = ups_in_turn(inner, [1], path, None, args.extra)[1]
                stack.push(inner.pop_all())
        finally:
            del os.environ[qdot.AMX_ENV]
        bench_out = os.path.join(out, os.path.basename(path).removesuffix(".gguf"))
        os.makedirs(bench_out, exist_ok=True)
        runs = measure_servers(servers, [1], bench_out, bench_args)
    result = {}
    for name, by_level in runs.items():
        each = [args.input_len / (m["mean_e2el_ms"] / 1e3) for m in by_level[1]]
        result[name] = {"prompt_tokens_per_s": round(sum(each) / len(each), 1),
                        "prompt_tokens_per_s_each_round": [round(v, 1) for v in each]}
    return result


def tables(results: list[dict], input_len: int) -> str:
    with_amx = any(AMX_LLAMA in r["servers"] for r in results)
    rows = [f"| model | server | {input_len}-token prompt, tok/s | × VNNI path | × llama-server |" +
            (" × llama-server (AMX build) |" if with_amx else ""),
            "| --- | --- | ---: | ---: | ---: |" + (" ---: |" if with_amx else "")]
    for r in results:
        s = r["servers"]
        vnni = s["stagemesh (VNNI, STAGEMESH_AMX=off)"]["prompt_tokens_per_s"]
        llama = s["llama-server"]["prompt_tokens_per_s"]
        llama_amx = s.get(AMX_LLAMA, {}).get("prompt_tokens_per_s")
        for name, v in s.items():
            tps = v["prompt_tokens_per_s"]
            rows.append(f"| {r['model']} | {name} | {tps:.0f} | {tps / vnni:.2f}× | {tps / llama:.2f}× |" +
                        (f" {tps / llama_amx:.2f}× |" if llama_amx else ""))
    rows += ["", "| model | matrix | type | shape | " + " | ".join(f"{m} rows" for m in ROWS) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---:" for _ in ROWS) + " |"]
    for r in results:
        for c in r["kernels"]:
            rows.append(f"| {r['model']} | {c['matrix']} | {c['type']} | {c['shape'][0]}x{c['shape'][1]} | " +
                        " | ".join(f"{p['vnni_ms'] / p['amx_ms']:.2f}×" for p in c["points"]) + " |")
    return "\n".join(rows)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        for c in r["kernels"]:
            ax.plot([p["rows"] for p in c["points"]], [p["vnni_ms"] / p["amx_ms"] for p in c["points"]], marker="o",
                    label=f"{r['model']} {c['matrix']} {c['type']} {c['shape'][0]}x{c['shape'][1]}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axvline(qdot.AMX_MIN_ROWS, color="grey", ls="--", lw=0.8, label=f"AMX_MIN_ROWS = {qdot.AMX_MIN_ROWS}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows in the call (tokens in the micro-batch)")
    ax.set_ylabel("integer-dot (VNNI) time / AMX time")
    ax.set_title("one matrix: AMX tiles against the integer-dot path")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arg(p, "amx")
    p.add_argument("--models", default="llama3.2-1b,llama3.2-3b",
                   help=f"comma-separated aliases, GGUF paths or shaped-file names ({', '.join(SHAPES)})")
    p.add_argument("--preset", default="Q4_K_M", help="llama.cpp quantization of the shaped files (default Q4_K_M)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (default 512: llama-bench's pp512)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the servers interleaved in each (default 3)")
    p.add_argument("--prompts", type=int, default=3, help="requests per round, one at a time (default 3)")
    p.add_argument("--llama-server", default=LLAMA_SERVER, help="path of llama.cpp's llama-server (make llama-server)")
    p.add_argument("--llama-server-amx", nargs="?", const=LLAMA_SERVER_AMX, default=None,
                   help="also measure llama-server built with ggml's AMX kernels (make llama-server-amx puts it at "
                        f"{LLAMA_SERVER_AMX}, the path without a value; its build of 2026-12 segfaulted in "
                        "ggml_backend_amx_mul_mat at its warm-up on a VM that grants the tile state)")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    if (why := qdot.amx_why_not()) is not None:
        sys.exit(f"the AMX path does not run on this machine: {why}")
    if not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server}: run `make llama-server` first")
    out = results_dir(args.out, "amx")
    results = []
    for name in args.models.split(","):
        path = model_file(name, args.preset)
        print(f"{name}: the kernel curve", flush=True)
        kernels = kernel_curve(path)
        print(f"{name}: the servers, {args.input_len}-token prompts", flush=True)
        results.append({"model": name, "file": os.path.basename(path), "kernels": kernels,
                        "servers": prefill_servers(path, args, out)})
        print(tables(results[-1:], args.input_len), flush=True)
    header = (f"{cpu_description()}; one stream, fresh random {args.input_len}-token prompts answered with one token "
              f"(ignore_eos), {args.rounds} round(s) of {args.prompts}, the servers interleaved; prompt tok/s = "
              f"{args.input_len} / mean end-to-end latency; llama-server -t {os.cpu_count()} -np 1 (`make llama-server`: built "
              "without AMX, whose ggml kernels segfault at llama-server's warm-up on the VMs this ran on"
              f"{'; its AMX build from `make llama-server-amx` beside it, its log in this folder' if args.llama_server_amx else ''}"
              "); stagemesh up "
              f"--stages 1 {' '.join(args.extra) or '(defaults)'}. Kernel table: integer-dot time / AMX time for "
              "one call of that many rows, best of 5 each")
    md = header + "\n\n" + tables(results, args.input_len)
    print(md)
    write_results(out, "amx", {"settings": header, "amx_min_rows": qdot.AMX_MIN_ROWS, "results": results}, md)
    plot(results, os.path.join(out, "amx.png"))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
