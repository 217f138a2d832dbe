"""ms per decode step of the whole SmolLM2 (one process, every layer + lm_head), per weights mode, side by side.

    .venv/bin/python -m benchmarks.decode_step [--weights auto,lean,bf16,f32] [--batch 1,8,32] [--context 64]
        [--batch-invariant] [--compile]

Each batch size decodes B sequences that each hold --context tokens of prompt; the fastest and the median of
--steps steps are printed (a shared machine only ever adds time, so the fastest is the better estimate). Runs
against whatever `shared` is on the path: PYTHONPATH=<an older tree> measures the code before a change (weights
modes it lacks are skipped; bf16 there is its default).

--compile also measures each mode loaded with compile_decode="on" (shared.models.compiled_decode: one sequence's
decode step under torch.compile with static shapes, one graph per context bucket, compiled at load; its load s
includes compilation, seconds when inductor's on-disk cache has the graphs). Only B=1 runs compiled; larger batches
run the eager step in both rows. Modes the compiled step does not cover (bf16, f32) are skipped.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

from shared.device import resolve_dtype
from shared.gguf_loader import GgufLoader
from shared.model_registry import resolve_model
from shared.protocol import SeqEntry
from shared.runtime import LocalPipeline
from shared.steps import Decode, Prefill


def load(loader: GgufLoader, weights: str, slots: int, batch_invariant: bool,
         compile_decode: bool = False) -> LocalPipeline | None:
    dtype = torch.float32 if weights == "f32" else resolve_dtype(None)  # the serving default: bf16 where it is fast
    params = inspect.signature(LocalPipeline.load).parameters
    if "weights" not in params:  # the code before weights modes existed
        return LocalPipeline.load(loader, None, dtype, kv_slots=slots) if weights in ("bf16", "f32") else None
    if not compile_decode:
        return LocalPipeline.load(loader, None, dtype, kv_slots=slots, weights=weights, batch_invariant=batch_invariant)
    if "compile_decode" not in params or weights not in ("auto", "lean"):
        return None
    return LocalPipeline.load(loader, None, dtype, kv_slots=slots, weights=weights, compile_decode="on")


def decode_ms(pipeline: LocalPipeline, batch: int, context: int, steps: int, step_fn=None) -> tuple[float, float]:
    warmup = 3  # first calls of a kernel at a new shape pay one-off costs
    steps += warmup
    ids = torch.randint(100, 40000, (context + steps,), generator=torch.Generator().manual_seed(0))
    seqs = [f"s{i}" for i in range(batch)]
    for s in seqs:
        pipeline.run([SeqEntry(s, Prefill(context, 0, context, True))], ids[:context])
    run = step_fn or pipeline.run
    times = []
    for k in range(steps):
        work = [SeqEntry(s, Decode(context + k)) for s in seqs]
        t = time.perf_counter()
        run(work, ids[context + k].repeat(batch))
        times.append(time.perf_counter() - t)
    times = times[warmup:]
    for s in seqs:
        pipeline.release(s)
    return 1e3 * min(times), 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="auto,lean,bf16,f32")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-invariant", action="store_true", help="also measure each mode with batch_invariant=True")
    p.add_argument("--compile", action="store_true", help="also measure each mode with --compile-decode")
    args = p.parse_args()
    loader = GgufLoader(resolve_model(args.model))
    batches = [int(b) for b in args.batch.split(",")]
    print(f"decode step, ms (fastest / median of {args.steps}), {torch.get_num_threads()} threads, "
          f"context {args.context} tokens per sequence")
    print(f"{'weights':<18}" + "".join(f"{f'B={b}':>16}" for b in batches) + f"{'load s':>9}")
    variants = [(w, False) for w in args.weights.split(",")]
    if args.batch_invariant:
        variants += [(w, True) for w in args.weights.split(",") if w != "f32"]
    for weights, invariant in variants:
        t = time.perf_counter()
        pipeline = load(loader, weights, max(batches), invariant)
        load_s = time.perf_counter() - t
        if pipeline is None:
            continue
        cells = [decode_ms(pipeline, b, args.context, args.steps) for b in batches]
        name = weights + (" +invariant" if invariant else "")
        print(f"{name:<18}" + "".join(f"{f'{lo:.1f} / {med:.1f}':>16}" for lo, med in cells) + f"{load_s:>9.2f}")
        del pipeline
        if args.compile and not invariant:
            t = time.perf_counter()
            pipeline = load(loader, weights, max(batches), False, compile_decode=True)
            load_s = time.perf_counter() - t
            if pipeline is not None:
                cells = [decode_ms(pipeline, b, args.context, args.steps) for b in batches]
                print(f"{weights + ' compiled':<18}" + "".join(f"{f'{lo:.1f} / {med:.1f}':>16}" for lo, med in cells)
                      + f"{load_s:>9.2f}")
                del pipeline


if __name__ == "__main__":
    main()
