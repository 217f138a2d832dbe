"""ms per decode step of the whole SmolLM2 (one process, every layer + lm_head), per weights mode, side by side.

    .venv/bin/python -m benchmarks.decode_step [--weights auto,lean,bf16,f32] [--batch 1,8,32] [--context 64]
        [--batch-invariant] [--compile]

Each batch size decodes B sequences that each hold --context tokens of prompt; the fastest and the median of
--steps steps are printed (a shared machine only ever adds time, so the fastest is the better estimate). Runs
against whatever `shared` is on the path: PYTHONPATH=<an older tree> measures the code before a change (weights
modes it lacks are skipped; bf16 there is its default).

--compile also measures each mode loaded with compile_decode="on" (shared.models.compiled_decode: one sequence's
decode step under torch.compile, static shapes but the context length, compiled at load; its load s
includes compilation, seconds when inductor's on-disk cache has the graphs). B=1 runs the one-sequence graph, B=2 up
to the largest --batch the batched graph where the model's layers are covered (float32 on an AVX2 CPU), else the
eager step. Modes the compiled step does not cover (bf16, f32) are skipped.

--arch llama,qwen2,... (or all) measures instead, for each architecture, a random model of SmolLM2's widths (576
hidden, 9 heads, 3 kv heads, 1536 MLP; --arch-layers layers, Q4_0 matrices; services/testing/tiny_gguf.py writes it)
decoding one sequence eagerly and compiled, and writes the table to --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from services.testing.harness import add_out_arg, results_dir, write_results
from services.testing.tiny_gguf import TinySpec, write_tiny_gguf
from shared.batch.steps import Decode, Prefill
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model
from shared.models.device import resolve_dtype
from shared.runtime.stage_runtime import LocalPipeline
from shared.wire.protocol import SeqEntry


def load(loader: GgufLoader, weights: str, slots: int, batch_invariant: bool,
         compile_decode: bool = False) -> LocalPipeline | None:
    dtype = torch.float32 if weights == "f32" else resolve_dtype(None)  # the serving default (shared.models.device)
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


ARCHS = ("llama", "mistral3", "qwen2", "qwen3", "qwen3moe", "starcoder2", "phi2", "phi3", "gemma", "gemma2", "gemma3")


def arch_spec(arch: str, layers: int) -> TinySpec:
    """SmolLM2's widths in `arch`'s block; the lm_head tied where the architecture requires it."""
    return TinySpec(arch=arch, layers=layers, hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536,
                    tied=arch in ("gemma", "gemma2"), rope_dim=32 if arch == "phi2" else None, quant="Q4_0",
                    weight_scale=0.64 / 576 ** 0.5, experts=8, experts_used=2)


def per_architecture(archs: list[str], layers: int, context: int, steps: int, out: str) -> None:
    """Eager against compiled one-sequence decode, per architecture (weights auto, the default dtype)."""
    rows = []
    print(f"decode step of one sequence, ms (fastest / median of {steps}), {torch.get_num_threads()} threads, "
          f"{layers} layers of SmolLM2's widths, Q4_0, context {context}")
    print(f"{'architecture':<14}{'eager':>16}{'compiled':>16}{'speed-up':>10}{'compile s':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            if len(archs) > 1:  # each in a process of its own, as a stage holds one model: dynamo's caches are per
                # process and per function, so models compiled one after another in one process share (and crowd) them
                sub = os.path.join(tmp, arch)
                subprocess.run([sys.executable, "-m", "benchmarks.decode_step", "--arch", arch, "--arch-layers",
                                str(layers), "--context", str(context), "--steps", str(steps), "--out", sub],
                               check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(sub, "decode_step_per_arch.json")) as f:
                    row = json.load(f)["rows"][0]
                eager, compiled, compile_s = row["eager_ms"], row["compiled_ms"], row["compile_s"]
                rows.append(row)
                print(f"{arch:<14}{f'{eager[0]:.2f} / {eager[1]:.2f}':>16}{f'{compiled[0]:.2f} / {compiled[1]:.2f}':>16}"
                      f"{eager[0] / compiled[0]:>9.2f}x{compile_s:>11.1f}", flush=True)
                continue
            loader = GgufLoader(write_tiny_gguf(os.path.join(tmp, f"{arch}.gguf"), arch_spec(arch, layers)))
            eager = decode_ms(load(loader, "auto", 1, False), 1, context, steps)
            t = time.perf_counter()
            pipeline = load(loader, "auto", 1, False, compile_decode=True)
            compile_s = time.perf_counter() - t
            compiled = decode_ms(pipeline, 1, context, steps)
            assert all(p.compiled.steps > 0 for p in pipeline.pieces), f"{arch}: the compiled step did not run"
            rows.append({"arch": arch, "eager_ms": eager, "compiled_ms": compiled, "compile_s": round(compile_s, 1)})
            print(f"{arch:<14}{f'{eager[0]:.2f} / {eager[1]:.2f}':>16}{f'{compiled[0]:.2f} / {compiled[1]:.2f}':>16}"
                  f"{eager[0] / compiled[0]:>9.2f}x{compile_s:>11.1f}")
    table = ["| architecture | eager ms | compiled ms | speed-up |", "| --- | ---: | ---: | ---: |"]
    table += [f"| {r['arch']} | {r['eager_ms'][0]:.2f} | {r['compiled_ms'][0]:.2f} | "
              f"{r['eager_ms'][0] / r['compiled_ms'][0]:.2f}x |" for r in rows]
    print("wrote", write_results(out, "decode_step_per_arch", {"layers": layers, "context": context, "steps": steps,
                                                               "threads": torch.get_num_threads(), "rows": rows},
                                 "\n".join(table)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="auto,lean,bf16,f32")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-invariant", action="store_true", help="also measure each mode with batch_invariant=True")
    p.add_argument("--compile", action="store_true", help="also measure each mode with --compile-decode")
    p.add_argument("--arch", default=None, help=f"measure these architectures instead (comma-separated, or all: "
                                                 f"{', '.join(ARCHS)})")
    p.add_argument("--arch-layers", type=int, default=8, help="layers of each --arch model")
    add_out_arg(p, "decode-step")
    args = p.parse_args()
    if args.arch:
        archs = list(ARCHS) if args.arch == "all" else args.arch.split(",")
        per_architecture(archs, args.arch_layers, args.context, args.steps, results_dir(args.out, "decode-step"))
        return
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
