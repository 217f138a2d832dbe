"""What distributed tracing costs: aggregate generated tokens/s of `stagemesh up --stages 2` without --otlp-endpoint
(the default: no span objects, no header field) and with it, exporting every request's trace to an OTLP/HTTP
receiver in this process (services/testing/otlp_receiver.py, decoding each export as a collector would). Both meshes run side
by side and the rounds alternate, so drift on a shared machine hits both equally.

It also times, in this process, what tracing adds per micro-batch (header encode + decode with and without the
trace context of 16 sequences, and one compute span's start and end with 15 links), which end-to-end noise on a
shared 2-core machine can hide.

    python -m benchmarks.otlp_overhead [--concurrency 16] [--max-tokens 32] [--rounds 3] [--dtype D] [--out DIR]

Writes otlp_overhead.json and otlp_overhead.md (what it printed) into --out (default: a new
benchmarks/results/<date>-otlp_overhead)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import timeit

import torch

from services.testing.harness import Report, add_dtype_arg, add_out_arg, dtype_label, run_level, running_up
from services.testing.otlp_receiver import OtlpReceiver
from shared.batch.steps import Decode
from shared.models.device import resolve_dtype
from shared.observe.otlp import OtlpTracer, otlp_endpoint
from shared.wire.protocol import ForwardBatch, SeqEntry, decode, encode


def per_microbatch_us(url: str, dtype: torch.dtype, seqs: int = 16, n: int = 2000) -> dict[str, float]:
    """Microseconds per micro-batch of `seqs` decodes (activations of `dtype`): header encode + decode without and
    with trace context, and a stagemesh.stage.compute-like span (parent + seqs - 1 links + 7 attributes) started and
    ended."""
    tracer = OtlpTracer(otlp_endpoint(url), "benchmark")
    roots = [tracer.start("stagemesh.request") for _ in range(seqs)]
    tps = [tracer.traceparent(r) for r in roots]
    hidden = torch.zeros(seqs, 576, dtype=dtype)

    def batch(traced: bool) -> ForwardBatch:
        return ForwardBatch(1, [SeqEntry(f"seq{i:012d}", Decode(100), traceparent=tps[i] if traced else None)
                                for i in range(seqs)], hidden=hidden, traceparent=tps[0] if traced else None)

    def span() -> None:
        tracer.end(tracer.start("stagemesh.stage.compute", tps[0], tps[1:], {
            "stagemesh.stage.layers": "0:15", "stagemesh.stage.position": "first", "stagemesh.microbatch.id": 1,
            "stagemesh.tokens": seqs, "stagemesh.sequences": seqs, "stagemesh.hop_ms": 0.1,
            "stagemesh.queue_wait_ms": 0.1}))

    off, on = batch(False), batch(True)
    runs = {"wire off": lambda: decode(encode(off)), "wire on": lambda: decode(encode(on)), "span": span}
    best = {k: min(timeit.repeat(fn, number=n // 10, repeat=10)) for k, fn in runs.items()}  # min: least disturbed
    for r in roots:
        tracer.end(r)
    tracer.shutdown()
    return {k: 1e6 * v / (n // 10) for k, v in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    add_dtype_arg(p)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    add_out_arg(p, "otlp_overhead")
    args = p.parse_args()
    report = Report("otlp_overhead", args.out)
    with OtlpReceiver() as rx:
        us = per_microbatch_us(rx.url, resolve_dtype(args.dtype))
    report.say(f"per micro-batch of 16 sequences: header encode+decode {us['wire off']:.1f} us without trace context, "
               f"{us['wire on']:.1f} us with it; one compute span with 15 links {us['span']:.1f} us")
    slots = ("--kv-slots", str(max(16, args.concurrency)))
    with OtlpReceiver() as rx:
        with contextlib.ExitStack() as stack:  # the traced up stops first: it flushes the spans still queued
            off_gw = stack.enter_context(running_up(args.stages, *slots, dtype=args.dtype))
            on_gw = stack.enter_context(running_up(args.stages, *slots, "--otlp-endpoint", rx.url, dtype=args.dtype))
            off, on = [], []
            for r in range(args.rounds):  # the order alternates too: neither side always runs first
                for gw, out in [(off_gw, off), (on_gw, on)][:: 1 if r % 2 == 0 else -1]:
                    out.append(asyncio.run(run_level(gw.url, args.concurrency, args.max_tokens)).tokens_per_s)
                report.say(f"  round {r + 1}: tracing off {off[-1]:7.1f} tok/s   on {on[-1]:7.1f} tok/s")
        time.sleep(2.0)
        spans = rx.spans()
    m_off, m_on = statistics.mean(off), statistics.mean(on)
    noise = statistics.stdev(off) / m_off if len(off) > 1 else float("nan")
    kinds = {name: sum(1 for s in spans if s.name == name) for name in sorted({s.name for s in spans})}
    report.say(f"otlp overhead: {args.stages} stages, {dtype_label(args.dtype)}, {args.concurrency} streams x {args.max_tokens} tokens, "
               f"{args.rounds} rounds: off {m_off:.1f} tok/s, on {m_on:.1f} tok/s (ratio on/off {m_on / m_off:.3f}; "
               f"run-to-run spread with tracing off {100 * noise:.1f}%); spans received {kinds}")
    report.write({"settings": vars(args) | {"dtype": dtype_label(args.dtype)}, "per_microbatch_us": us,
                  "tokens_per_s_off": off, "tokens_per_s_on": on, "spans_received": kinds})


if __name__ == "__main__":
    main()
