"""StageStats: the stage's one ledger. Every counter and timing a stage reports is kept here once, written by the
stage loop (and by its transport, TransportStats), and read by /info and by the Prometheus collector
(services/stage/metrics.py) at the moment they are asked -- so the two can never disagree.

What other parts own (the KV cache's slots, the prefetch inbox's depth) is not copied in: readers ask the owner."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from shared.wire.transport import TransportStats

# Micro-batch sizes (tokens) grouped into a few classes, so compute time per size is one bounded label.
SIZE_CLASSES = ((1, "1"), (8, "2-8"), (32, "9-32"), (128, "33-128"), (512, "129-512"))
LARGEST_CLASS = "513+"
SIZE_CLASS_NAMES = tuple(name for _, name in SIZE_CLASSES) + (LARGEST_CLASS,)
COMPUTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


def size_class(tokens: int) -> str:
    return next((name for top, name in SIZE_CLASSES if tokens <= top), LARGEST_CLASS)


@dataclass
class Timings:
    """Durations observed into fixed buckets (a Prometheus histogram's numbers): `counts[i]` observations fell in
    (buckets[i-1], buckets[i]], the last entry past every bucket; `seconds` is their sum, `count` how many."""

    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    seconds: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.seconds += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, observations at or below it)], infinity last: what a histogram exposes."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class StageStats:
    """Cumulative since the process started. `transport` is the transport's own TransportStats (bytes, sending time,
    rejects, failed handshakes), written by it alone."""

    transport: TransportStats = field(default_factory=TransportStats)
    compute: dict[str, Timings] = field(  # compute time per micro-batch, by size_class of its tokens
        default_factory=lambda: {name: Timings(COMPUTE_BUCKETS) for name in SIZE_CLASS_NAMES})
    hop: Timings = field(default_factory=lambda: Timings(HOP_BUCKETS))  # upstream's send to this stage's receipt
    tokens: int = 0  # tokens computed
    waiting_seconds: float = 0.0  # the compute loop waiting for input
    reclaimed: int = 0  # KV slots released because their lease expired
    errors: int = 0  # micro-batches that failed on this stage
    resplits: int = 0  # live re-splits this stage committed (shared/runtime/resplit.py), its layers changed or not
    head_seconds: float = 0.0  # of the compute time, the last stage's final norm + lm_head + sampling

    def computed(self, seconds: float, tokens: int) -> None:
        """One micro-batch of `tokens` tokens took `seconds` to compute."""
        self.compute[size_class(tokens)].observe(seconds)
        self.tokens += tokens

    @property
    def busy_seconds(self) -> float:
        return sum(t.seconds for t in self.compute.values())

    @property
    def microbatches(self) -> int:
        return sum(t.count for t in self.compute.values())

    @property
    def bubble_ratio(self) -> float:
        """Share of the compute loop's time spent waiting for input (0 before anything ran)."""
        busy = self.busy_seconds
        return self.waiting_seconds / (self.waiting_seconds + busy) if self.waiting_seconds + busy else 0.0
