"""A stage's speed on its own host, measured at start (`stagemesh stage --calibrate ROWS`, which `up --split auto`
passes): decode steps of its own layers, back to back, at each batch size the gateway expects; and the memory the
host has free for more layers. The gateway's --split auto turns every stage's figures into a split
(shared.runtime.plan.proposal) and moves the mesh to it before it reports ready.

A throttled host (a pod's CPU limit, a cgroup's cpu.cfs_quota_us) runs at full speed until its quota for the period
is spent, then not at all: a median of a few steps would miss it. So each batch size runs for at least
CALIBRATE_S wall-clock (ten of the kernel's default 100 ms periods) and its time is the mean over that whole span.

It also measures the host's read bandwidth (a STREAM triad, shared.runtime.roofline) with the same threads: with the
bytes a step of its layers reads, the stage's /metrics states its decode as a fraction of the memory roofline."""

from __future__ import annotations

import time

import torch

from shared.batch.steps import Decode, Prefill
from shared.models.memory import available_bytes
from shared.runtime.roofline import TRIAD_ARRAY_BYTES, triad_bandwidth
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.protocol import SeqEntry

CALIBRATE_S = 1.0  # wall-clock per batch size: ten CFS periods, so a throttled share shows in the mean
CALIBRATE_CONTEXT = 32  # positions each calibrating sequence holds before its decode steps
WARM_STEPS = 2  # untimed: a kernel's first call at a shape pays one-off costs
MIN_STEPS = 8


def calibrate(runtime: StageRuntime, rows: list[int], min_seconds: float = CALIBRATE_S, bandwidth: bool = True) -> dict:
    """Mean ms of one decode step of this stage's layers at each batch size in `rows` (clamped to its KV slots),
    each timed over at least `min_seconds`; the bytes this host has free now; and where `bandwidth`, its read bandwidth
    with the threads torch has (a triad over arrays of at most an eighth of the free bytes each). JSON-able:
    {"rows": [b...], "ms_per_step": [ms...], "seconds": s, "free_bytes": n, "bandwidth": bytes/s}, and on the last
    stage "head_ms": [ms...], the norm + lm_head's part of each step (timed apart, over half as long)."""
    model = runtime.model
    hidden_size = model.config.hidden_size
    ms, head_ms, took = [], [], time.perf_counter()
    sizes = sorted({max(1, min(b, runtime.kv.num_slots)) for b in rows})
    for b in sizes:
        ids = [f"calibrate{i}" for i in range(b)]

        def inputs(n: int) -> dict:  # token ids into the first stage, a hidden [n, D] into any other
            if model.has_embedding:
                return {"token_ids": torch.randint(100, 1000, (n,))}
            return {"hidden": torch.randn(n, hidden_size) * 0.1}

        for s in ids:
            runtime.run([SeqEntry(s, Prefill(CALIBRATE_CONTEXT, 0, CALIBRATE_CONTEXT, True))],
                        **inputs(CALIBRATE_CONTEXT))
        position = CALIBRATE_CONTEXT
        last = runtime.kv.max_seq_len - 1  # a sequence's positions stop here: the timing stops too
        try:
            for _ in range(WARM_STEPS):
                runtime.run([SeqEntry(s, Decode(position)) for s in ids], **inputs(b))
                position += 1
            steps, t0 = 0, time.perf_counter()
            while (steps < MIN_STEPS or time.perf_counter() - t0 < min_seconds) and position < last:
                runtime.run([SeqEntry(s, Decode(position)) for s in ids], **inputs(b))
                position, steps = position + 1, steps + 1
            ms.append(round(1e3 * (time.perf_counter() - t0) / max(1, steps), 4))
        finally:
            for s in ids:
                runtime.release(s)
        if model.has_lm_head:
            head_ms.append(_head_ms(runtime, b, min_seconds / 2))
    free = available_bytes()
    result = {"rows": sizes, "ms_per_step": ms, "seconds": round(time.perf_counter() - took, 3), "free_bytes": free}
    if bandwidth:
        result["bandwidth"] = round(triad_bandwidth(array_bytes=max(2**20, min(TRIAD_ARRAY_BYTES, free // 8))))
    if model.has_lm_head:  # its share of each step: the split moves layers, the head stays on the last stage
        result["head_ms"] = head_ms
    return result


def _head_ms(runtime: StageRuntime, rows: int, min_seconds: float) -> float:
    """Mean ms of the last stage's norm + lm_head over hidden [rows, D], timed over at least min_seconds."""
    x = torch.randn(rows, runtime.model.config.hidden_size) * 0.1
    with torch.inference_mode():
        for _ in range(WARM_STEPS):
            runtime.model.lm_head(x)
        steps, t0 = 0, time.perf_counter()
        while steps < MIN_STEPS or time.perf_counter() - t0 < min_seconds:
            runtime.model.lm_head(x)
            steps += 1
    return round(1e3 * (time.perf_counter() - t0) / steps, 4)
