"""Where the int4 kernel stops paying, measured on this machine when a stage loads (weights mode `auto`).

int4 g32 reads 4x fewer weight bytes than bf16 but unpacks every group per call; oneDNN's prepacked bf16 kernel
amortises its weight reads over the rows of a micro-batch (and uses AMX where the CPU has it). So int4 wins at
decode-sized micro-batches and bf16 at prefill-sized ones, and the crossover moves with the CPU: 9 tokens on a
2-core Zen 4 (benchmarks/kernels.py), elsewhere something else. A SwitchedLinear runs int4 below `max_tokens`
rows; this sets that threshold from a timing of the stage's own first block (about 0.1 s at load).
"""

from __future__ import annotations

import time

import torch

from shared.models.linear import SwitchedLinear

CANDIDATES = (2, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64)  # token counts tried, ascending
REPEAT = 5  # fastest of REPEAT timings per kernel and size (noise on a shared machine only ever adds time)


def _best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def measure_int4_crossover(linears: list[SwitchedLinear], repeat: int = REPEAT) -> int:
    """The smallest candidate token count at which prepacked bf16 beats int4 over `linears` (timed interleaved,
    each kernel's fastest of `repeat`); the largest candidate + 1 when int4 wins at every one of them."""
    inputs = {w.in_features: torch.randn(CANDIDATES[-1], w.in_features).to(torch.bfloat16) for w in linears}
    for w in linears:  # warm up both kernels (first calls allocate and pick code paths)
        w.small(inputs[w.in_features][:1])
        w.large(inputs[w.in_features][:1])
    for m in CANDIDATES:
        xs = [inputs[w.in_features][:m] for w in linears]
        small = _best_ms(lambda xs=xs: [w.small(x) for w, x in zip(linears, xs)], repeat)
        large = _best_ms(lambda xs=xs: [w.large(x) for w, x in zip(linears, xs)], repeat)
        if large < small:
            return m
    return CANDIDATES[-1] + 1


def apply_measured_crossover(model) -> int | None:
    """Measure on the model's first block and set every SwitchedLinear's threshold; returns it (None: the model
    has no switched linears, e.g. weights bf16 / f32 / int4 or the batch-invariant mode)."""
    switched = [w for b in model.blocks for w in b.linears().values() if isinstance(w, SwitchedLinear)]
    if not switched:
        return None
    first = [w for w in model.blocks[0].linears().values() if isinstance(w, SwitchedLinear)] or switched[:4]
    threshold = measure_int4_crossover(first)
    for w in switched + ([model.output] if isinstance(model.output, SwitchedLinear) else []):
        w.max_tokens = threshold
        w.kind = f"{w.small.kind} (< {threshold} tokens, measured) | {w.large.kind}"
    return threshold
