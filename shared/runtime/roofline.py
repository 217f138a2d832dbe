"""The memory roofline of one-stream decode. A decode step of one row reads every weight of the layers it runs once
(and the K/V its positions hold), and does a few operations per byte read: its time is bounded below by those bytes
over the host's read bandwidth. So one stream can go at most

    roofline tok/s = bandwidth (bytes/s) / bytes a token reads

and a server's one-stream decode tok/s over that is the fraction of the host's memory system it uses. The bandwidth is
measured here as STREAM's triad does (a = b + s * c over arrays far beyond any cache, every torch thread); the bytes are
the file's, as the GGUF stores them (ModelFacts): the least any server of that file can read (a stage that runs a
matrix dense reads more than the file holds, and its fraction shows it). `stagemesh plan` prints the fraction it
predicts; benchmarks/roofline.py measures it for stagemesh and llama-server side by side."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from shared.runtime.plan import ModelFacts

TRIAD_ARRAY_BYTES = 2**28  # each of the triad's three float32 arrays: 256 MiB, far past a server CPU's last-level cache
TRIAD_PASSES = 5  # timed passes (the best counts, as STREAM reports), after one untimed that touches the pages


def triad_bandwidth(array_bytes: int = TRIAD_ARRAY_BYTES, passes: int = TRIAD_PASSES,
                    threads: int | None = None) -> float:
    """Bytes a second this host moves in a STREAM triad a = b + 3 * c over float32 arrays of `array_bytes` each, with
    `threads` torch threads (None: as many as torch has): STREAM's count, 3 arrays a pass (2 read, 1 written), of the
    fastest of `passes` passes."""
    if array_bytes < 4 or passes < 1:
        raise ValueError(f"triad needs array_bytes >= 4 and passes >= 1, got {array_bytes} and {passes}")
    n = array_bytes // 4
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        b, c, a = torch.full((n,), 1.0), torch.full((n,), 2.0), torch.empty(n)  # (the values do not matter)
        torch.add(b, c, alpha=3.0, out=a)  # untimed: the first write commits a's pages
        best = math.inf
        for _ in range(passes):
            t = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return 3 * n * 4 / best


def token_bytes(model: ModelFacts, layers: range | None = None, head: bool = True, context: int = 0) -> int:
    """Bytes a one-row decode step of `layers` (None: every layer) reads: their weights as the file stores them, the
    head's when `head` (the last stage), and the K/V of `context` positions in each of those layers."""
    layers = range(model.num_layers) if layers is None else layers
    return (sum(model.layer_bytes[i] for i in layers) + (model.head_bytes if head else 0)
            + context * model.kv_bytes_per_token_layer * len(layers))


@dataclass(frozen=True)
class Roofline:
    """One host's bound on one-stream decode of one model (or one stage's share of it)."""

    bandwidth: float  # bytes/s the host reads (triad_bandwidth)
    bytes_per_token: int  # what a token's step reads (token_bytes)

    @property
    def tokens_per_s(self) -> float:
        """The most tokens a second one stream can make on this host."""
        return self.bandwidth / self.bytes_per_token

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.bytes_per_token / self.bandwidth

    def fraction(self, tokens_per_s: float) -> float:
        """A measured or predicted one-stream speed as a share of the roofline (1.0: every byte at full bandwidth)."""
        return tokens_per_s / self.tokens_per_s
