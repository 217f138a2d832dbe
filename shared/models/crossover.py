"""Which kernel runs which micro-batch size in weights mode `auto`, measured on this machine when a piece loads.

Two measurements, both because the answer moves with the CPU:

- the prefill kernel (measure_prefill_dtype): oneDNN-prepacked bf16 or float32 for prefill-sized micro-batches. With
  AMX, bf16 wins by far; on AVX512-BF16 without AMX oneDNN's f32 GEMM can outrun its bf16 one from a few dozen rows
  on; on AVX2 bf16 is emulated and f32 wins everywhere (benchmarks/kernels.py measures both on a machine).
- the int4 crossover (apply_measured_crossover): int4 g32 reads a quarter of bf16's bytes (an eighth of f32's) but
  unpacks every group per call; the dense kernel amortises its weight reads over the micro-batch's rows. So int4
  wins decode-sized micro-batches and the dense kernel prefill-sized ones. A SwitchedLinear runs int4 below
  `max_tokens` rows; this sets that threshold from timings of the piece's first CROSSOVER_BLOCKS blocks.

The crossover is timed over several distinct blocks so that, as in a real step, each matrix comes from memory rather
than from cache: one block's matrices stay cache-resident and make the dense kernel look faster at fewer rows than a
whole model's step shows (benchmarks/kernels.py times both).

Both are measured once per machine and shape and kept in a plans file (kernel_plan: ~/.cache/stagemesh/
kernel-plans.json, or $STAGEMESH_KERNEL_PLANS; "off" measures at every load), so the same file loads with the same
kernels from run to run and a load does not time kernels again. Delete the file to measure anew (e.g. after a
first start on a busy machine).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from shared.config import SCHEDULER_DEFAULTS
from shared.kernels.plans import PLANS_ENV, kernel_plan, timing_alone  # noqa: F401 (PLANS_ENV: the tests set it)
from shared.models.device import cpu_has_fast_bf16
from shared.models.linear import DenseLinear, SwitchedLinear

CANDIDATES = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # token counts tried, ascending
REPEAT = 5  # the prefill probe: fastest of REPEAT timings per kernel (noise on a shared machine only ever adds time)
# The crossover is timed over this many distinct blocks, fastest of CROSSOVER_REPEAT (their weights no longer fit in a
# core's cache, and each timing is long enough to average out a VM's jitter): on the 2-core VM fewer blocks gave a
# different crossover from run to run, these the whole model's every time (benchmarks/kernels.py times the whole
# model), in under a second.
CROSSOVER_BLOCKS = 8
CROSSOVER_REPEAT = 3
PREFILL_PROBE_MAX = 2048  # the prefill kernels are timed on a matrix of the model's MLP shape, capped at this per side


def _best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


@functools.cache
def measure_prefill_dtype(out_features: int, in_features: int, rows: int = SCHEDULER_DEFAULTS.prefill_chunk,
                          repeat: int = REPEAT) -> torch.dtype:
    """bfloat16 or float32: whichever oneDNN-prepacked GEMM multiplies a prefill chunk (`rows` x in_features) by a
    random [out_features, in_features] matrix faster here (interleaved, each kernel's fastest of `repeat`; a fraction
    of a second, once per process and shape). float32 where oneDNN has no native bf16 (it would be emulated)."""
    if not cpu_has_fast_bf16():
        return torch.float32
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    kernels = {dtype: DenseLinear(w, dtype, prepack_f32=True) for dtype in (torch.bfloat16, torch.float32)}
    for kernel in kernels.values():  # first calls allocate and pick code paths
        kernel(x)
    best = {dtype: float("inf") for dtype in kernels}
    for _ in range(repeat):
        for dtype, kernel in kernels.items():
            best[dtype] = min(best[dtype], _best_ms(lambda k=kernel: k(x), 1))
    return min(best, key=best.__getitem__)


def choose_prefill_dtype(config) -> torch.dtype:
    """auto's prefill kernel: measure_prefill_dtype on the model's MLP shape (capped at PREFILL_PROBE_MAX a side),
    this machine's kernel plan. Whether a copy in it fits in memory is shared.models.memory's decision."""
    n, k = min(config.intermediate_size, PREFILL_PROBE_MAX), min(config.hidden_size, PREFILL_PROBE_MAX)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    name, _ = kernel_plan(f"prefill kernel {n}x{k}", lambda: str(measure_prefill_dtype(n, k)).removeprefix("torch."),
                          lambda v: v in dtypes)
    return dtypes[name]


def crossover(timings: Callable[[int], tuple[float, float]]) -> int:
    """The smallest candidate token count from which the dense kernel beats the quantized one at that candidate and the
    next one too (one noisy win in the flat region where the two are within a few percent does not end the scan; a
    win at the last candidate stands alone);
    the largest candidate + 1 when the quantized kernel wins throughout. timings(m) -> (quantized ms, dense ms) at m
    tokens, asked in ascending order and no further than the answer needs."""
    dense_won_at = None
    for m in CANDIDATES:
        small, large = timings(m)
        if large >= small:
            dense_won_at = None
        elif dense_won_at is not None:
            return dense_won_at
        else:
            dense_won_at = m
    return dense_won_at or CANDIDATES[-1] + 1


def measure_int4_crossover(linears: list[SwitchedLinear], repeat: int = CROSSOVER_REPEAT,
                           seen: dict[int, tuple[float, float]] | None = None) -> int:
    """crossover() over `linears`, each candidate timed interleaved, each kernel's fastest of `repeat`; `seen` (when
    given) gets the timings it was decided from."""
    inputs = {w.in_features: torch.randn(CANDIDATES[-1], w.in_features).to(torch.bfloat16) for w in linears}
    for w in linears:  # warm up both kernels (first calls allocate and pick code paths)
        w.small(inputs[w.in_features][:1])
        w.large(inputs[w.in_features][:1])

    def timings(m: int) -> tuple[float, float]:
        xs = [inputs[w.in_features][:m] for w in linears]
        small = _best_ms(lambda: [w.small(x) for w, x in zip(linears, xs)], repeat)
        large = _best_ms(lambda: [w.large(x) for w, x in zip(linears, xs)], repeat)
        if seen is not None:
            seen[m] = (small, large)
        return small, large

    return crossover(timings)


def apply_measured_crossover(model) -> int | None:
    """Measure on the model's first CROSSOVER_BLOCKS blocks and set every SwitchedLinear's threshold; returns it
    (None: the model has no switched linears, e.g. weights bf16 / f32 / int4 or the batch-invariant mode)."""
    switched = [w for b in model.blocks for w in b.linears().values() if isinstance(w, SwitchedLinear)]
    if not switched:
        return None
    timed = [w for b in model.blocks[:CROSSOVER_BLOCKS] for w in b.linears().values() if isinstance(w, SwitchedLinear)]
    timed = timed or switched[:4 * CROSSOVER_BLOCKS]
    shapes = sorted({f"{w.small.kind}/{w.large.kind} {w.out_features}x{w.in_features}" for w in timed})
    threshold, _ = kernel_plan(f"int4 crossover over {len(timed)} of {', '.join(shapes)}",
                               lambda: measure_int4_crossover(timed), lambda v: v in (*CANDIDATES, CANDIDATES[-1] + 1))
    for w in switched + ([model.output] if isinstance(model.output, SwitchedLinear) else []):
        w.max_tokens = threshold
        w.kind = f"{w.small.kind} (< {threshold} tokens, measured) | {w.large.kind}"
    return threshold
