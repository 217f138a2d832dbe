"""All of SmolLM2's linears per step (30 layers x 4 fused matmuls + lm_head), ms, int4 g32 vs oneDNN-prepacked bf16
vs oneDNN-prepacked f32 (the two candidates for weights auto's prefill kernel), at several token counts; prints where
the dense kernels start to beat int4 (what shared.models.crossover measures at load, over the piece's first
CROSSOVER_BLOCKS blocks) and what int4's bf16 scales cost in fidelity against the GGUF's exact numbers.

    .venv/bin/python -m benchmarks.kernels [--tokens 1,2,4,8,12,16,32,48,64,128,512] [--repeat 5]

Only ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shared.files.gguf_loader import GgufLoader, RawTensor
from shared.files.model_registry import resolve_model
from shared.models.linear import DenseLinear, Int4Linear
from shared.models.quant import apply_groups, dequantize, unpack_levels


def _step_ms(kinds: list[list], xs: dict[int, torch.Tensor], m: int, repeat: int) -> list[float]:
    """Fastest of `repeat` steps per kind, the kinds interleaved (a shared machine's noise only ever adds time)."""
    best = [float("inf")] * len(kinds)
    for _ in range(repeat):
        for i, weights in enumerate(kinds):
            t = time.perf_counter()
            for w in weights:
                w(xs[w.in_features][:m])
            best[i] = min(best[i], time.perf_counter() - t)
    return [1e3 * b for b in best]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", default="1,2,4,8,12,16,24,32,48,64,128,512")
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args()
    loader = GgufLoader(resolve_model(args.model))
    n_layers = int(loader.arch_get("block_count"))
    groups = [["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"]]
    int4, bf16, f32 = [], [], []
    scale_err, weight_noise, two_part = [], [], []
    for i in range(n_layers):
        for g in groups:
            raws = [loader.raw(f"blk.{i}.{n}.weight") for n in g]
            data = torch.cat([r.data for r in raws])
            raw = RawTensor("+".join(g), raws[0].ggml_type, (sum(r.shape[0] for r in raws), raws[0].shape[1]), data)
            q, scale, low = unpack_levels(raw)
            exact = apply_groups(q, scale, low)
            w4 = Int4Linear(q, scale, low)
            int4.append(w4)
            bf16.append(DenseLinear(exact, torch.bfloat16))
            f32.append(DenseLinear(exact, torch.float32, prepack_f32=True))
            if i % 10 == 0:  # int4's weights as the kernel sees them (bf16 scale/zero) vs the GGUF's exact ones
                sz = w4.scales_and_zeros.float()
                seen = torch.addcmul(sz[..., 1].t()[..., None], q.view(q.shape[0], -1, 32).float() - 8,
                                     sz[..., 0].t()[..., None]).reshape(exact.shape)
                scale_err.append(((seen - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item())
                bf = exact.bfloat16().float()
                # would two bf16 parts (hi + lo, i.e. two int4 matmuls) carry scale and zero exactly?
                zero = low + 8 * scale
                two_part += [(v.bfloat16().float() + (v - v.bfloat16().float()).bfloat16().float() == v).float().mean().item()
                             for v in (scale, zero)]
                weight_noise.append(((bf - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item())
    head = dequantize(loader.raw("output.weight" if loader.has_tensor("output.weight") else "token_embd.weight"))
    head_w = DenseLinear(head, torch.bfloat16)
    tokens = [int(t) for t in args.tokens.split(",")]
    xs = {k: torch.randn(max(tokens), k).bfloat16() for k in {w.in_features for w in int4}}
    print(f"{torch.get_num_threads()} threads; ms per step for all {len(int4)} block matmuls (+ lm_head {head_w.kind})")
    print(f"{'tokens':>6} {'int4 g32':>9} {'bf16 prepacked':>15} {f32[0].kind:>15} {'int4/bf16':>9} {'bf16/f32':>8}")
    crossover = {"bf16": None, "f32": None}
    for m in tokens:
        a, b, c = _step_ms([int4, bf16, f32], xs, m, args.repeat)
        print(f"{m:>6} {a:>9.2f} {b:>15.2f} {c:>15.2f} {a / b:>9.2f} {b / c:>8.2f}")
        for name, t in (("bf16", b), ("f32", c)):
            if crossover[name] is None and t < a:
                crossover[name] = m
    (h,) = _step_ms([[head_w]], xs, 1, args.repeat)
    print(f"lm_head alone at 1 token: {h:.2f} ms")
    print(f"crossover: prepacked bf16 first beats int4 at {crossover['bf16']} tokens, prepacked f32 at "
          f"{crossover['f32']} (weights auto measures its own at load)")
    print(f"int4's bf16 scales/zeros: weight error rms {statistics.mean(scale_err):.2e} of weight rms "
          f"(rounding the dequantized weights to bf16 instead: {statistics.mean(weight_noise):.2e}); "
          f"scales and zeros exact as hi + lo bf16 pairs: {100 * statistics.mean(two_part):.2f} %")


if __name__ == "__main__":
    main()
