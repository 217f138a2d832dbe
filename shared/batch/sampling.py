"""Sampling on the last stage: penalties, logit bias, the grammar's allowed tokens, then greedy or temperature,
top-k, top-p, min-p with a per-request seed.

A seeded draw depends only on (seed, position) and the sequence's own logits, so the same request gives the
same tokens whatever else shares its micro-batch, and a replay after a stage restart reproduces it."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import numpy as np
import torch

MAX_TOP_K = 1_000_000
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_REPETITION_PENALTY = 10.0
MAX_ALLOWED_MASK_BYTES = 1 << 16  # a grammar's allowed-token bitmask: vocabularies up to 524,288 tokens
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
    # OpenAI's penalties on generated tokens (vLLM's semantics): logit -= frequency x count + presence x (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # llama.cpp's and vLLM's: a logit of a token seen in the prompt or the output is divided (> 0) or multiplied (< 0)
    repetition_penalty: float = 1.0
    top_logprobs: int = 0  # this many most likely alternatives (with their logprobs) per sampled token, 0..20

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
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError("presence_penalty and frequency_penalty must lie within -2..2")
        if not (0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must lie within (0, {MAX_REPETITION_PENALTY:g}], got "
                             f"{self.repetition_penalty}")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must lie within 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed}")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed (drawn now when none was given)."""
        if self.seed is not None or self.greedy:
            return self
        return SamplingParams(**{**asdict(self), "seed": random.getrandbits(62)})

    def to_wire(self) -> dict:
        """The fields that differ from their defaults (every micro-batch carries each sequence's: a greedy one's is
        {}); from_wire fills in the rest. Worked out once per (immutable) instance: a sequence's parameters are
        encoded at every step and hop. The caller must not change the dict."""
        wire = self.__dict__.get("_wire")
        if wire is None:
            wire = {name: value for name, default in _DEFAULTS.items() if (value := getattr(self, name)) != default}
            object.__setattr__(self, "_wire", wire)
        return wire

    @classmethod
    def from_wire(cls, d: dict) -> SamplingParams:
        return cls(**d)


_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
WIRE_FIELDS = frozenset(_DEFAULTS)


@dataclass(frozen=True)
class LogitInputs:
    """What a sequence's own history adds to one sampling step, computed by whoever holds that history (the
    gateway) and carried with the step, so a stage keeps no per-sequence sampling state and a replay on a fresh
    stage samples exactly as before.

    allowed: the grammar's allowed tokens as a little-endian bitmask (bit t of 32-bit word t // 32 set = token t may
    be sampled; the layout llguidance and xgrammar fill); tokens past its end are not allowed. None: no grammar.
    seen: (token id, times generated) of every token the penalties look at -- generated tokens, and with a
    repetition penalty also the prompt's (count 0 when only in the prompt)."""

    allowed: bytes | None = None
    seen: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if self.allowed is not None and not (0 < len(self.allowed) <= MAX_ALLOWED_MASK_BYTES
                                             and len(self.allowed) % 4 == 0):
            raise ValueError(f"an allowed-token mask is 4..{MAX_ALLOWED_MASK_BYTES} bytes in 32-bit words, got "
                             f"{len(self.allowed)}")
        if any(t < 0 or c < 0 for t, c in self.seen):
            raise ValueError("seen token ids and counts must be >= 0")

    @property
    def empty(self) -> bool:
        return self.allowed is None and not self.seen

    def to_wire(self) -> dict:
        wire: dict = {}
        if self.allowed is not None:
            wire["allow"] = self.allowed
        if self.seen:
            wire["seen"] = [x for pair in self.seen for x in pair]  # flat: id, count, id, count, ...
        return wire

    @classmethod
    def from_wire(cls, d: dict) -> LogitInputs:
        if not isinstance(d, dict) or not set(d) <= {"allow", "seen"}:
            raise ValueError("logit inputs must be a map with keys from allow, seen")
        allowed, flat = d.get("allow"), d.get("seen", [])
        if allowed is not None and not isinstance(allowed, bytes):
            raise ValueError("'allow' must be bytes")
        if not (isinstance(flat, list) and len(flat) % 2 == 0 and all(type(x) is int for x in flat)):
            raise ValueError("'seen' must be a flat list of (token id, count) integer pairs")
        return cls(allowed, tuple(zip(flat[0::2], flat[1::2])))


def one_position_a_step(params: SamplingParams, constrained: bool) -> bool:
    """The rule of steps of several positions: a sequence whose samples take logit inputs -- the penalties' history
    (params.penalized), a grammar's allowed tokens (`constrained`) -- steps one position at a time, since those inputs
    hold for the next position only. So a k-token step (k > 1: a decode verifying drafts) carries no logit inputs: the
    gateway drafts for no such sequence (SequenceState.next_step, the Speculator) and the last stage refuses one
    (shared.wire.protocol.sampling_rows)."""
    return constrained or params.penalized


def _apply_penalties(row: torch.Tensor, p: SamplingParams, seen: tuple[tuple[int, int], ...]) -> None:
    """In place, on one row of logits (vLLM's order: repetition, then frequency and presence)."""
    ids = torch.tensor([t for t, _ in seen], dtype=torch.int64)
    if int(ids.max()) >= row.numel():
        raise ValueError(f"penalties name token {int(ids.max())}, past the vocabulary's {row.numel()}")
    counts = torch.tensor([c for _, c in seen], dtype=torch.float32)
    if p.repetition_penalty != 1.0:
        vals = row[ids]
        row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    generated = counts > 0
    row[ids] -= p.frequency_penalty * counts + p.presence_penalty * generated.float()


def _allowed_mask(allowed: bytes, vocab: int) -> torch.Tensor:
    """The bitmask -> bool [vocab] (little-endian words and bytes: bit t of byte t // 8)."""
    bits = torch.frombuffer(bytearray(allowed), dtype=torch.uint8)
    mask = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()
    if mask.numel() >= vocab:
        return mask[:vocab]
    return torch.cat([mask, torch.zeros(vocab - mask.numel(), dtype=torch.bool)])


TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first; ties by token id ascending


class Samples(NamedTuple):
    """What sample() returns, one entry per row: the chosen tokens, and (where that row's params ask) the chosen
    token's logprob and the top_logprobs most likely alternatives, both under the unmodified distribution."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[TopLogprobs | None]


def _top_logprobs(logprobs: torch.Tensor, k: int) -> TopLogprobs:
    """The k most likely tokens of one row of log-probabilities [V], most likely first, ties by token id
    ascending (whatever order torch.topk leaves tied values in)."""
    kth = torch.topk(logprobs, k).values[-1]
    ids = (logprobs >= kth).nonzero().flatten()  # ascending ids; k of them, more when the k-th value is tied
    values, order = torch.sort(logprobs[ids], descending=True, stable=True)
    return list(zip(ids[order[:k]].tolist(), values[:k].tolist()))


# One sampled token is a handful of whole-vocabulary passes (49,152 logits for SmolLM2), each a few tens of µs when
# vectorized, so every pass here is: torch's exp, numpy's compares, argmax and sums (torch's argmax and boolean
# compares are scalar loops at this size, several times slower). Only what can be in the support is ever sorted:
# CANDIDATE_FLOORS are probabilities relative to the most likely token's; the tokens at least that likely are found
# with one compare, and when they hold the k tokens (top-k) or top_p of the mass (top-p) only they are sorted, else
# the next, lower floor; past the last, the whole row. Exact: every token outside the candidates is less likely than
# every token inside, so the k most likely tokens, or the smallest most-likely prefix reaching top_p, lie among them.
CANDIDATE_FLOORS = (1e-3, 1e-6)
DRAW_BLOCK = 1024  # a draw finds its block of tokens from block sums, then cumulates that block only


def _uniform(seed: int, position: int) -> float:
    """One reproducible draw in [0, 1) for (seed, position)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + position) % (2**63))
    return float(torch.rand(1, generator=g, dtype=torch.float64))


def _most_likely(probs: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids ordered by probability, most likely first; ties by token id ascending."""
    return ids[np.argsort(-probs[ids], kind="stable")]


def _candidates(probs: np.ndarray, enough) -> np.ndarray:
    """The tokens at least CANDIDATE_FLOORS[i] as likely as the most likely one (probs' max is 1), at the first floor
    whose set is `enough`; past the last floor, every token. Ascending ids."""
    for floor in CANDIDATE_FLOORS:
        ids = np.flatnonzero(probs >= floor)
        if enough(ids):
            return ids
    return np.arange(probs.size)


def tempered(logits: torch.Tensor, params: list[SamplingParams]) -> list[np.ndarray]:
    """softmax(row / T) x its largest's inverse, exp((row - max) / T), for each row of logits [M, V] float32 with its
    params' temperature: float32 [V] each, the most likely token's 1 (logits stay as they were). Where the integer-dot
    kernels load, qdot.cpp's temper does every row in one call, rows split over torch's threads; else torch, row by
    row. Either way a row's numbers depend on that row alone, never on what else is sampled with it."""
    if not params:
        return []
    # imported here: the gateway imports this module and should not pay for importing shared.models' package at start
    from shared.kernels import qdot

    if qdot.usable():
        inv_t = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32)
        return list(qdot.temper(logits, inv_t).numpy())
    return [(row - row.max()).mul_(1.0 / p.temperature).exp_().numpy() for row, p in zip(logits, params)]


def _filtered_probs(probs: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray | None]:
    """A row's tempered probabilities (`tempered`) after top-k, top-p and min-p: (probs float32, the token ids they
    belong to, or None for all). Not normalized: the most likely token's is 1, and the draw scales by their sum."""
    ids = None
    if p.top_k and p.top_k < probs.size:
        ids = _most_likely(probs, _candidates(probs, lambda c: c.size >= p.top_k))[:p.top_k]
        probs = probs[ids]
        mass = probs.sum(dtype=np.float64)  # top-p, if asked too, within the top k
    elif p.top_p < 1.0:
        mass = probs.sum(dtype=np.float64)
        ids = _most_likely(probs, _candidates(probs, lambda c: probs[c].sum(dtype=np.float64) >= p.top_p * mass))
        probs = probs[ids]
    if p.top_p < 1.0 and ids is not None:  # the smallest most-likely prefix whose share of the mass reaches top_p
        cum = np.cumsum(probs, dtype=np.float64)
        keep = int(np.count_nonzero(cum - probs < p.top_p * mass))
        probs, ids = probs[:keep], ids[:keep]
    if p.min_p > 0.0:  # the kept tokens stay in their order; the most likely one always stays
        keep_mask = probs >= p.min_p * probs.max()
        ids = np.flatnonzero(keep_mask) if ids is None else ids[keep_mask]
        probs = probs[keep_mask]
    return probs, ids


def _draw(probs: np.ndarray, u: float) -> int:
    """The index i with cdf[i - 1] <= u x total < cdf[i] (inverse transform; a token of probability 0 is never
    drawn): the block from DRAW_BLOCK-token block sums, then the token within that block."""
    full = probs.size // DRAW_BLOCK * DRAW_BLOCK
    sums = probs[:full].reshape(-1, DRAW_BLOCK).sum(1)  # float32 (pairwise), then cumulated in float64
    if full < probs.size:
        sums = np.append(sums, probs[full:].sum())
    cdf = np.cumsum(sums, dtype=np.float64)
    target = u * cdf[-1]
    # the last block with any mass caps it: u x total can round up to the total
    b = min(int(np.searchsorted(cdf, target, side="right")), int(np.flatnonzero(sums)[-1]))
    block = probs[b * DRAW_BLOCK:(b + 1) * DRAW_BLOCK]
    inner = np.cumsum(block, dtype=np.float64)
    i = int(np.searchsorted(inner, target - (cdf[b - 1] if b else 0.0), side="right"))
    if i >= block.size:  # the block's own sum rounded below the block sums' share: its last drawable token
        i = int(np.flatnonzero(block)[-1])
    return b * DRAW_BLOCK + i


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           inputs: list[LogitInputs | None] | None = None) -> Samples:
    """logits [M, V] float32, one row per sequence; positions: each sampled token's position; inputs: each row's
    LogitInputs (penalties' history, grammar mask), None where there are none.
    Logprobs and top alternatives come from log_softmax of the row's own logits before penalties, bias and mask,
    so a row's are the same whatever else shares the batch."""
    logits = logits.float().cpu()  # every pass below is a CPU one (and numpy's)
    unbiased = logits
    inputs = inputs or [None] * len(params)
    adjusted = [i for i, (p, li) in enumerate(zip(params, inputs))
                if p.logit_bias or (li is not None and (li.allowed is not None or (li.seen and p.penalized)))]
    if adjusted:  # a row's adjustments touch that row only
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in adjusted:
            p, li = params[i], inputs[i]
            if li is not None and li.seen and p.penalized:
                _apply_penalties(logits[i], p, li.seen)
            if p.logit_bias:
                ids, bias = zip(*p.logit_bias)
                if max(ids) >= vocab:
                    raise ValueError(f"logit_bias names token {max(ids)}, past the vocabulary's {vocab}")
                logits[i, list(ids)] += torch.tensor(bias)
            if li is not None and li.allowed is not None:
                mask = _allowed_mask(li.allowed, vocab)
                if not bool(mask.any()):
                    raise ValueError("the grammar's allowed-token mask permits no token of this vocabulary")
                logits[i].masked_fill_(~mask, -math.inf)
    tokens: list[int] = [0] * len(params)
    logprobs: list[float | None] = [None] * len(params)
    top: list[TopLogprobs | None] = [None] * len(params)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    rows = logits if len(drawn) == len(params) else logits[drawn]
    probs_of = dict(zip(drawn, tempered(rows, [params[i] for i in drawn])))
    for i, p in enumerate(params):
        if p.greedy:  # numpy's argmax: the first of equal maxima, as torch's, in a tenth of its time
            tokens[i] = int(logits[i].numpy().argmax())
        else:
            probs, ids = _filtered_probs(probs_of.pop(i), p)
            seed = p.seed if p.seed is not None else random.getrandbits(62)
            pick = _draw(probs, _uniform(seed, positions[i]))
            tokens[i] = int(ids[pick]) if ids is not None else pick
        if p.logprobs or p.top_logprobs:
            row = torch.log_softmax(unbiased[i], dim=-1)  # [V]
            if p.logprobs:
                logprobs[i] = float(row[tokens[i]])
            if p.top_logprobs:
                top[i] = _top_logprobs(row, min(p.top_logprobs, row.numel()))
    return Samples(tokens, logprobs, top)
