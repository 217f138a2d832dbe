"""Q2_K and Q3_K matrices at 1B widths on the integer-dot kernels (shared/kernels/qdot.py's q2_k / q3_k ops) against
what ran them before: the dense kernel (weights auto: dense_dtype(), oneDNN-prepacked, a dense copy of the matrix)
and int8 rows (weights lean: Int8Linear); and, for scale, the same matrix quantized to Q4_K on its integer-dot
kernel (q4_1 blocks). Per matrix and token count, each kernel's best of `repeat` timings of
`calls` calls, the kernels taken in turn (a shared machine's noise only ever adds time), and each one's time as a
multiple of the integer-dot kernel's; the bytes each holds against the file's bytes of the matrix. The blocks are
written by llama.cpp's own quantizer (services.testing.tiny_gguf.ggml_quantize_rows) from a weight-like random
matrix: what a Q2_K / Q3_K_M file holds.

    .venv/bin/python -m benchmarks.kquant_low [--shapes 2048x2048,8192x2048] [--tokens 1,8,16] [--threads 1] [--out DIR]

Only ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from services.testing.tiny_gguf import ggml_quantize_rows
from shared.files.gguf_loader import RawTensor
from shared.models.linear import DenseLinear, Int8Linear, QdotLinear, dense_dtype
from shared.models.quant import dequantize


def _best_ms(kernels: dict, x: torch.Tensor, repeat: int, calls: int) -> dict[str, float]:
    best = {name: float("inf") for name in kernels}
    for kernel in kernels.values():
        kernel(x)
    for _ in range(repeat):
        for name, kernel in kernels.items():
            t = time.perf_counter()
            for _ in range(calls):
                kernel(x)
            best[name] = min(best[name], (time.perf_counter() - t) * 1e3 / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="Q2_K,Q3_K")
    p.add_argument("--shapes", default="2048x2048,8192x2048", help="N x K: output rows x input width")
    p.add_argument("--tokens", default="1,8,16")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch's threads (1: on a busy 2-core machine a second "
                   "thread's preemption stalls every call at its slowest)")
    p.add_argument("--out", default=None, help="a results folder: kquant_low.json and kquant_low.md go there")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows, lines = [], []
    head = (f"torch threads {torch.get_num_threads()}, dense kernel {dense_dtype()}, load average "
            f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} at the start")
    print(head)
    lines += [head, "", "| type | N x K | tokens | integer-dot ms | dense (auto before) | int8 rows (lean before) "
              "| the same matrix in Q4_K, on its kernel |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for qtype in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            matrix = (np.random.default_rng(0).standard_normal((n, k)) * (0.64 / np.sqrt(k))).astype(np.float32)
            raw = RawTensor("w", qtype, (n, k), torch.from_numpy(ggml_quantize_rows(matrix, qtype)))
            q4_k = RawTensor("w", "Q4_K", (n, k), torch.from_numpy(ggml_quantize_rows(matrix, "Q4_K")))
            kernels = {"integer-dot": QdotLinear(raw),
                       "dense": DenseLinear(dequantize(raw), dense_dtype(), prepack_f32=True),
                       "int8 rows": Int8Linear.from_raw(raw),
                       "Q4_K integer-dot": QdotLinear(q4_k)}
            held = {name: w.nbytes / raw.data.nbytes for name, w in kernels.items() if not name.startswith("Q4_K")}
            print(f"{qtype} {n}x{k}: bytes held / the file's " + ", ".join(f"{a} {b:.3f}x" for a, b in held.items()))
            lines.append(f"| {qtype} | {n} x {k} | bytes / file | {held['integer-dot']:.3f}x | {held['dense']:.3f}x "
                         f"| {held['int8 rows']:.3f}x | |")
            for m in (int(v) for v in args.tokens.split(",")):
                x = torch.randn(m, k)
                ms = _best_ms(kernels, x, args.repeat, args.calls)
                base = ms["integer-dot"]
                print(f"  {m:3d} tokens: " + ", ".join(f"{a} {b:.3f} ms ({b / base:.2f}x)" for a, b in ms.items()))
                lines.append(f"| {qtype} | {n} x {k} | {m} | {base:.3f} | {ms['dense']:.3f} ({ms['dense'] / base:.2f}x) "
                             f"| {ms['int8 rows']:.3f} ({ms['int8 rows'] / base:.2f}x) "
                             f"| {ms['Q4_K integer-dot']:.3f} ({ms['Q4_K integer-dot'] / base:.2f}x) |")
                rows.append({"type": qtype, "n": n, "k": k, "tokens": m, "ms": ms, "bytes_per_file_byte": held})
    tail = f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end"
    print(tail)
    lines += ["", tail]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kquant_low.json"), "w") as f:
            json.dump({"threads": torch.get_num_threads(), "dense_dtype": str(dense_dtype()), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "kquant_low.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
