"""Sampling on the last stage: greedy, temperature, top-k, top-p, per-request seed.

A seeded draw depends only on (seed, position) and the sequence's own logits, so the same request gives the
same tokens whatever else shares its micro-batch, and a replay after a stage restart reproduces it."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

MAX_TOP_K = 1_000_000


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None: drawn once at the edge so the request stays reproducible
    logprobs: bool = False

    def __post_init__(self):
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be within 0..100, got {self.temperature}")
        if not (0 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be 0 (off) or a positive count, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed (drawn now when none was given)."""
        if self.seed is not None or self.greedy:
            return self
        return SamplingParams(**{**asdict(self), "seed": random.getrandbits(62)})

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> SamplingParams:
        return cls(**d)


def _draw_generator(seed: int, position: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + position) % (2**63))
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> tuple[list[int], list[float | None]]:
    """logits [M, V] float32, one row per sequence; positions: each sampled token's position.
    Returns token ids and (when asked) the chosen token's log-probability under the unmodified distribution."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    logprobs: list[float | None] = [None] * len(params)
    want_lp = any(p.logprobs for p in params)
    log_probs = torch.log_softmax(logits, dim=-1) if want_lp else None
    for i, p in enumerate(params):
        if not p.greedy:
            row = logits[i] / p.temperature
            if p.top_k and p.top_k < row.numel():
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)
                cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
                drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p  # keep the smallest set reaching top_p
                row = row.scatter(0, order[drop], float("-inf"))
            probs = torch.softmax(row, dim=-1)
            seed = p.seed if p.seed is not None else random.getrandbits(62)
            tokens[i] = int(torch.multinomial(probs, 1, generator=_draw_generator(seed, positions[i])))
        if p.logprobs and log_probs is not None:
            logprobs[i] = float(log_probs[i, tokens[i]])
    return tokens, logprobs
