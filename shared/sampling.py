"""Sampling on the last stage: greedy, temperature, top-k, top-p, per-request seed.

A seeded draw depends only on (seed, position) and the sequence's own logits, so the same request gives the
same tokens whatever else shares its micro-batch, and a replay after a stage restart reproduces it."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

MAX_TOP_K = 1_000_000
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
# Below this temperature the draw is greedy (vLLM's _SAMPLING_EPS): logits / 1e-38 overflow float32 and the
# softmax turns to NaN; at 1e-5 a logit gap of 1e-4 is already e^-10 apart, i.e. greedy for any real model.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or anything below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None: drawn once at the edge so the request stays reproducible
    logprobs: bool = False
    min_p: float = 0.0  # 0 = off; else drop tokens less likely than min_p x the most likely one (after temperature)
    # ((token id, bias), ...) added to those logits before anything else (OpenAI's logit_bias: -100 bans, +100 forces)
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be within 0..100, got {self.temperature}")
        if not (0 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be 0 (off) or a positive count, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be within 0..1, got {self.min_p}")
        try:  # from the wire: a list of [id, bias] pairs
            bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must be (token id, bias) pairs, got {self.logit_bias!r}") from None
        if len(bias) > MAX_LOGIT_BIAS or any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids >= 0, each biased by -100..100")
        object.__setattr__(self, "logit_bias", bias)
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

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


NUCLEUS_CANDIDATES = 1024  # top-p looks here first; a full sort only when these hold less than top_p of the mass


def _uniform(seed: int, position: int) -> float:
    """One reproducible draw in [0, 1) for (seed, position)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + position) % (2**63))
    return float(torch.rand(1, generator=g, dtype=torch.float64))


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after temperature, top-k, top-p and min-p: (probs, token ids they belong to, or None for all);
    probs are not renormalized (the draw scales by their sum)."""
    row = row / p.temperature
    if p.top_k and p.top_k < row.numel():
        values, ids = torch.topk(row, p.top_k)  # sorted, descending
        probs = torch.softmax(values, dim=-1)
    elif p.top_p < 1.0:
        probs_all = torch.softmax(row, dim=-1)
        k = min(NUCLEUS_CANDIDATES, row.numel())
        probs, ids = torch.topk(probs_all, k)
        if float(probs.sum()) < p.top_p and k < row.numel():
            probs, ids = torch.sort(probs_all, descending=True)
    else:
        probs, ids = torch.softmax(row, dim=-1), None
    if p.top_p < 1.0 and ids is not None:
        cum = probs.cumsum(0)
        keep = int((cum - probs < p.top_p).sum())  # the smallest prefix whose mass reaches top_p
        probs, ids = probs[:keep], ids[:keep]
    if p.min_p > 0.0:  # the kept tokens stay in their order; the most likely one always stays
        keep_mask = probs >= p.min_p * probs.max()
        ids = keep_mask.nonzero().flatten() if ids is None else ids[keep_mask]
        probs = probs[keep_mask]
    return probs, ids


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> tuple[list[int], list[float | None]]:
    """logits [M, V] float32, one row per sequence; positions: each sampled token's position.
    Returns token ids and (when asked) the chosen token's log-probability under the unmodified distribution."""
    logits = logits.float()
    unbiased = logits
    if any(p.logit_bias for p in params):  # a row's bias touches that row only
        logits = logits.clone()
        for i, p in enumerate(params):
            if p.logit_bias:
                ids, bias = zip(*p.logit_bias)
                if max(ids) >= logits.shape[-1]:
                    raise ValueError(f"logit_bias names token {max(ids)}, past the vocabulary's {logits.shape[-1]}")
                logits[i, list(ids)] += torch.tensor(bias)
    tokens = logits.argmax(dim=-1).tolist()
    logprobs: list[float | None] = [None] * len(params)
    for i, p in enumerate(params):
        if not p.greedy:
            probs, ids = _filtered_probs(logits[i], p)
            seed = p.seed if p.seed is not None else random.getrandbits(62)
            cdf = probs.double().cumsum(0)
            pick = int(torch.searchsorted(cdf, _uniform(seed, positions[i]) * float(cdf[-1]), right=True))
            pick = min(pick, probs.numel() - 1)
            tokens[i] = int(ids[pick]) if ids is not None else pick
        if p.logprobs:
            logprobs[i] = float(torch.log_softmax(unbiased[i], dim=-1)[tokens[i]])
    return tokens, logprobs
