"""Drafts for a sequence's next decode step, verified in that step (several positions a step: shared/batch/steps.py,
SequenceState.take). A wrong draft costs only the rows it added to one pass, never a different token.

Where a draft comes from (Speculator.draft), first found first:
- the client's own `prediction` (OpenAI's Predicted Outputs: the text it expects, e.g. the file being edited): what
  the prediction says comes next after the newest output tokens (PredictionIndex);
- without one, n-grams (`--speculation auto` or `on`, and the request did not send `"speculation": false`):
  - its own context (prompt lookup): the tokens that followed the longest recent suffix of prompt + output found
    earlier in them (ContextIndex);
  - the shared pool (llama.cpp's ngram-mod): a fixed table from a rolling hash of POOL_NGRAM tokens to the token that
    last followed them, written from every request's accepted output, so an answer another request already gave
    drafts itself (NgramPool). Hashes are keyed by the request's cache tenant, as prefixes are: a tenant's speed never
    tells what another one generated.

When (the load policy): a decode's draft rows compete with the other sequences of its micro-batch, so drafts go only
where the rows are nearly free: a micro-batch's rows (each decode's newest token and its drafted ones) stay within
DRAFT_ROWS, and none share a micro-batch with a prompt chunk; n-gram drafts, which stand less often than a prediction,
only while the pipeline runs at most NGRAM_MAX_RUNNING sequences. How long: drafts that do not stand shrink the next
and pause drafting (DraftBudget, per request), and a draft is cut to the length that gives the most tokens a second
by this mesh's measured cost of a pass of that many rows (PassCosts) and the request's measured acceptance (its
first draft goes whole, to measure it; a prediction's drafts stand in runs, so their first token's chance is
measured by how well the draft was located and the later tokens' apart, RequestDrafts.record) -- to nothing where no
length beats a pass without one. `--speculation on`
skips the load limit and the costs (to measure what drafts do, and to test them)."""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.gateway.engine.drafts import ContextIndex, DraftBudget, PredictionIndex
from shared.batch.sampling import one_position_a_step
from shared.config import SPECULATION_MODES

if TYPE_CHECKING:  # the request carries its drafting state (drafts.py); the drafter above reads it
    from services.gateway.engine.request import Request

POOL_NGRAM = 8  # tokens the pool's hash covers (the n of llama.cpp's ngram-mod)
POOL_BITS = 20  # the pool holds 2**POOL_BITS entries (4 MiB), whatever the traffic
DRAFT_ROWS = 16  # a micro-batch's rows with drafts at most: decodes' newest tokens and the drafted ones
NGRAM_MAX_RUNNING = 4  # n-gram drafts only while the pipeline runs at most this many sequences
SOURCES = ("prediction", "context", "pool")
COST_WINDOW = 16  # the latest passes of a row count whose fastest is its cost (others' load only ever adds time)
EXPLORE_EVERY = 32  # drafts the costs refused in a row before one goes anyway, so the costs of more rows are measured
#                     again (a host that was busy once does not turn drafting off for good)

_MASK = (1 << 64) - 1
_BASE = 6364136223846793005  # llama.cpp's ngram-mod multiplier
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of hash * _MIX index the table


def tenant_salt(tenant: str) -> int:
    """A cache tenant's key for the pool's hashes (the shared tenant "" included)."""
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "little")


class NgramPool:
    """llama.cpp's ngram-mod: a rolling hash of `n` tokens (keyed by a salt) -> the token that last followed them, in
    a table of 2**bits entries. Constant memory: a new n-gram overwrites whatever shared its entry (no key is kept,
    so a collision drafts a wrong token, which costs a row and never an output token)."""

    def __init__(self, n: int = POOL_NGRAM, bits: int = POOL_BITS):
        self.n = n
        self.bits = bits
        self.table = array("i", [-1]) * (1 << bits)
        self.used = 0  # entries ever written
        self._top = _BASE ** (n - 1) & _MASK  # what the window's oldest token weighs in the hash

    def __len__(self) -> int:
        return len(self.table)

    def _hash(self, window: Sequence[int]) -> int:
        h = 0
        for t in window:
            h = (h * _BASE + t + 1) & _MASK
        return h

    def _roll(self, h: int, oldest: int, newest: int) -> int:
        return ((h - (oldest + 1) * self._top) * _BASE + newest + 1) & _MASK

    def _index(self, h: int, salt: int) -> int:
        return (((h ^ salt) * _MIX) & _MASK) >> (64 - self.bits)

    def add(self, ids: Sequence[int], start: int, salt: int = 0) -> None:
        """Record, for every token ids[j] with j >= start (and j >= n), that it followed ids[j - n:j]."""
        n, table = self.n, self.table
        start = max(start, n)
        if start >= len(ids):
            return
        h = self._hash(ids[start - n:start])
        for j in range(start, len(ids)):
            i = self._index(h, salt)
            if table[i] < 0:
                self.used += 1
            table[i] = ids[j]
            h = self._roll(h, ids[j - n], ids[j])

    def draft(self, ids: Sequence[int], size: int, salt: int = 0) -> list[int]:
        """Up to `size` tokens, each what followed the n tokens before it (the last n of ids, then the drafted ones
        join them); stops at the first n-gram the table has no token for."""
        n = self.n
        if len(ids) < n or size <= 0:
            return []
        window = list(ids[-n:])
        h = self._hash(window)
        out: list[int] = []
        while len(out) < size:
            t = self.table[self._index(h, salt)]
            if t < 0:
                break
            out.append(t)
            h = self._roll(h, window[len(out) - 1], t)
            window.append(t)
        return out


class PassCosts:
    """The measured seconds of a decode pass through the whole pipeline, by its rows: micro-batches of decodes only,
    each alone in the pipeline (sent with nothing else in flight and back before anything else was sent), so its
    round trip is its pass. What a row costs depends on the kernels, the hops and the host; measuring it is how
    drafting knows whether its rows pay here."""

    def __init__(self):
        self._passes: dict[int, deque[float]] = {}  # rows -> the seconds of its latest COST_WINDOW passes

    def observe(self, rows: int, seconds: float) -> None:
        self._passes.setdefault(rows, deque(maxlen=COST_WINDOW)).append(seconds)

    @property
    def seconds(self) -> dict[int, float]:
        """rows -> the cost of a pass of that many rows: the fastest of its latest passes (a first pass that warmed
        kernels up, or one that shared the host with other work, took longer than the pass itself does)."""
        return {rows: min(times) for rows, times in self._passes.items()}

    def ratio(self, rows: int, base: int) -> float | None:
        """A pass of `rows` rows over one of `base` rows (rows >= base), from the measured row counts nearest to each
        (linear between two measured ones, the largest measured's own beyond it); None before the base's nearest and
        one count above it are measured (drafting then explores)."""
        seconds = self.seconds
        if not any(r <= base for r in seconds) or not any(r > base for r in seconds):
            return None
        return interpolate(seconds, rows) / interpolate(seconds, base)


def interpolate(seconds: dict[int, float], rows: int) -> float:
    """The time of a pass of `rows` rows from measured ones (rows -> time): linear between the measured row counts
    nearest it, the nearest's own beyond them."""
    known = sorted(seconds)
    lo = max((r for r in known if r <= rows), default=known[0])
    hi = min((r for r in known if r >= rows), default=known[-1])
    if lo == hi:
        return seconds[lo]
    return seconds[lo] + (seconds[hi] - seconds[lo]) * (rows - lo) / (hi - lo)


def worth_drafting(size: int, p: float, costs: PassCosts, base: int, first: float | None = None) -> int:
    """The draft length up to `size` giving the most tokens a second when the first drafted token stands with
    probability `first` (default p) and each later one with probability p once all before it stood: k drafted tokens
    give 1 + first * (1 + p + ... + p^(k-1)) tokens for a pass of base + k rows; 0 when no length beats the pass
    without a draft. Unmeasured costs: `size` (explore)."""
    first = p if first is None else first
    best, best_rate, tokens, reach = 0, 1.0, 1.0, first
    for k in range(1, size + 1):
        ratio = costs.ratio(base + k, base)
        if ratio is None:
            return size
        tokens, reach = tokens + reach, reach * p  # reach: the chance the k-th drafted token stands
        if tokens / ratio > best_rate:
            best, best_rate = k, tokens / ratio
    return best


@dataclass
class SpeculationStats:
    """What drafting did, by source (SOURCES): summed over every request and replica; /metrics and the mesh view."""

    drafted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))  # drafted tokens verified
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))  # ... that stood
    verify_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))  # decode steps with a draft
    decode_steps: int = 0  # every sequence's decode steps (one a sequence a pass), with a draft or without
    decode_tokens: int = 0  # the tokens they produced: one each, and the drafted ones that stood
    draft_seconds: float = 0.0  # time spent making drafts (the gateway's CPU, on its event loop)

    @property
    def tokens_per_pass(self) -> float | None:
        """Tokens one sequence's decode step produced on average: 1 without speculation."""
        return self.decode_tokens / self.decode_steps if self.decode_steps else None

    @property
    def hit_rate(self) -> float | None:
        """Drafted tokens that stood, of those verified."""
        drafted = sum(self.drafted.values())
        return sum(self.accepted.values()) / drafted if drafted else None

    def info(self) -> dict:
        rate, per_pass = self.hit_rate, self.tokens_per_pass
        return {"drafted": sum(self.drafted.values()), "accepted": sum(self.accepted.values()),
                "hit_rate": None if rate is None else round(rate, 4),
                "tokens_per_pass": None if per_pass is None else round(per_pass, 4),
                "decode_steps": self.decode_steps, "draft_ms": round(self.draft_seconds * 1e3, 3),
                "by_source": {s: {"drafted": self.drafted[s], "accepted": self.accepted[s],
                                  "steps": self.verify_steps[s]} for s in SOURCES}}


class Speculator:
    """The gateway's drafter, shared by every pipeline's scheduler (one pool for all): `draft` proposes a request's
    next draft, `verified` learns from what stood. mode: --speculation -- auto (the load and the measured costs
    decide), on (n-gram drafts at any load and whatever their rows cost: to measure what drafts do, and to test
    them), off (predictions only)."""

    def __init__(self, mode: str = "auto", pool: NgramPool | None = None):
        if mode not in SPECULATION_MODES:
            raise ValueError(f"speculation mode {mode!r}: one of {', '.join(SPECULATION_MODES)}")
        self.mode = mode
        self.pool = pool if pool is not None or mode == "off" else NgramPool()
        self.stats = SpeculationStats()
        self.costs = PassCosts()
        self._refused = 0  # drafts the measured costs cut to nothing since one last went (EXPLORE_EVERY)

    def ngrams_for(self, req: Request) -> bool:
        """Whether n-gram drafts may serve this request at all: on, not opted out, no prediction of its own, and
        a step whose draws can be verified in rows (no grammar or penalties: they need one position a step)."""
        return req.prediction_ids is None and self._context_for(req)

    def _context_for(self, req: Request) -> bool:
        """ngrams_for, a prediction or not: a request with one drafts from its own context where its output left
        the prediction."""
        return self.pool is not None and req.speculation and req.audit is None and not req.traced \
            and not one_position_a_step(req.params, req.grammar is not None)

    def draft(self, req: Request, rows: int, ngrams: bool, batch_rows: int = 1) -> list[int]:
        """The draft for the request's next decode step, at most `rows` tokens long, in a micro-batch of batch_rows
        rows without it; `ngrams`: the load allows n-gram drafts now. Sets req.draft and returns it."""
        drafts, t0 = req.drafts, time.perf_counter()
        draft, source = [], None
        if req.prediction_ids and drafts.prediction is None:
            drafts.prediction, drafts.budget = PredictionIndex(req.prediction_ids), DraftBudget(predicted=True)
        size = min(rows, drafts.budget.size)
        ngrams = ngrams or self.mode == "on"
        if size > 0 and (req.prediction_ids or (ngrams and self.ngrams_for(req))) and drafts.budget.next_size():
            if req.prediction_ids:  # where it re-joins the prediction, or what its context or the pool says, by
                # which came more often for this request; else one token alike in the prediction near where the
                # output left it (an offline replay of edits chose the order)
                draft, source = self._predicted_draft(req, size, ngrams)
                if not draft:
                    draft, source = drafts.prediction.draft(req.output_ids, size), "prediction"
            else:
                draft, source = self._context_draft(req, size), "context"
                if not draft:
                    draft, source = self.pool.draft(req.all_ids, size, self._salt(req)), "pool"
            drafts.located = drafts.prediction.matched if source == "prediction" else 0
            if draft and self.mode == "auto" and (drafts.stood or drafts.missed):  # as long as pays on this mesh (a request's first draft
                # goes whole: it measures how well this request's drafts stand)
                if req.prediction_ids:
                    keep = worth_drafting(len(draft), drafts.later_chance, self.costs, batch_rows,
                                          first=drafts.first_chance(drafts.located))
                else:
                    keep = worth_drafting(len(draft), drafts.acceptance, self.costs, batch_rows)
                self._refused = 0 if keep or self._refused + 1 >= EXPLORE_EVERY else self._refused + 1
                draft = draft[:keep or (len(draft) if self._refused == 0 else 0)]
        drafts.source = source if draft else None
        req.draft = draft
        self.stats.draft_seconds += time.perf_counter() - t0
        return draft

    def _predicted_draft(self, req: Request, size: int, ngrams: bool) -> tuple[list[int], str]:
        """A request with a prediction: the prediction's draft where at least 2 output tokens locate it, its
        context's, and the pool's while the load allows n-grams (`ngrams`); of those that start otherwise, the one
        whose source's first tokens came more often for this request lately (RequestDrafts.first_hits, learnt from
        every candidate: a prediction that stops standing -- the output renames what it names -- hands over to the
        context, and takes over again where it stands again), the earlier in that order on a tie. So a prediction
        never drafts worse than n-grams alone would (benchmarks/draft_replay.py replays the policy on known answers)."""
        drafts = req.drafts
        candidates = {"prediction": drafts.prediction.draft(req.output_ids, size, shortest=2)}
        if self._context_for(req):
            candidates["context"] = self._context_draft(req, size)
            if ngrams:
                candidates["pool"] = self.pool.draft(req.all_ids, size, self._salt(req))
        drafts.candidates = candidates
        # the prediction first, then its context, then the pool: a later one wins only where its draft starts
        # otherwise and its first tokens came more often
        best = "prediction"
        for source in ("context", "pool"):
            d, b = candidates.get(source), candidates[best]
            if d and (not b or (d[0] != b[0] and drafts.first_hit_chance(source) > drafts.first_hit_chance(best))):
                best = source
        return candidates[best], best

    def _context_draft(self, req: Request, size: int) -> list[int]:
        if req.drafts.context is None:
            req.drafts.context = ContextIndex()
        return req.drafts.context.draft(req.all_ids, size)

    def verified(self, req: Request, decoded: bool, drafted: int, stood: int) -> None:
        """The request's step came back: `decoded` (a decode step, not a prompt chunk) with `drafted` drafted tokens,
        `stood` of them standing. Sizes its next draft, counts, and gives its new tokens' n-grams to the pool."""
        s = self.stats
        if decoded:
            s.decode_steps += 1
            s.decode_tokens += 1 + stood
        source, req.drafts.source = req.drafts.source, None
        if decoded and req.drafts.candidates:
            req.drafts.learn_candidates(req.output_ids[len(req.output_ids) - stood - 1:])
        if decoded and req.drafts.prediction is not None:
            req.drafts.prediction.stepped(drafted if source == "prediction" else 0, stood)
            if source == "prediction":  # the request's usage (OpenAI's accepted / rejected prediction tokens)
                req.drafts.prediction_stood += stood
                req.drafts.prediction_rejected += drafted - stood
        if drafted and source is not None:
            req.drafts.budget.update(drafted, stood)
            req.drafts.record(drafted, stood)
            s.drafted[source] += drafted
            s.accepted[source] += stood
            s.verify_steps[source] += 1
        if self.pool is not None and req.speculation and req.audit is None and req.output_ids:
            ids = req.all_ids
            start = max(req.drafts.pooled, len(req.prompt_ids))
            self.pool.add(ids, start, self._salt(req))
            req.drafts.pooled = len(ids)

    def _salt(self, req: Request) -> int:
        if req.drafts.salt is None:
            req.drafts.salt = tenant_salt(req.cache_tenant)
        return req.drafts.salt

    def info(self) -> dict:
        """The mesh view's: mode, what drafting did, and the pool's fill."""
        return {"mode": self.mode, **self.stats.info(),
                "pass_ms": {rows: round(t * 1e3, 3) for rows, t in sorted(self.costs.seconds.items())},
                "pool_used": None if self.pool is None else self.pool.used,
                "pool_entries": None if self.pool is None else len(self.pool)}
