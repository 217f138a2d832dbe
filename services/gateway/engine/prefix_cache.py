"""The gateway's prefix cache index: which finished sequences every stage still keeps, and what they hold.

A layer split makes a prefix reusable only if *every* stage holds its K/V, so one controller owns the index (as
vLLM's scheduler and llama.cpp's RPC host do): the gateway. A finished sequence is not released but kept on every
stage (ReleaseSeqs.keep) and indexed here by chained hashes of its full BLOCK_TOKENS-token blocks; a new sequence
whose prompt starts with indexed blocks attaches the longest such prefix (Prefill.attach: each stage copies those
positions' K/V into the new slot) and prefills only the rest. A stage that no longer keeps a prefix answers
prefix_miss; the scheduler drops it from here and prefills that sequence in full.

Kept prefixes live in the stages' KV rows that running sequences leave free (each stage has --prefix-slots rows
beyond its --kv-slots for them): running + kept <= those rows, and admission evicts the least recently used prefix
that no admitted sequence is about to attach. Their K/V is bounded per stage (--prefix-cache-memory): the
scheduler evicts by the positions they hold (held_positions) before a stage has to. Pure bookkeeping, no I/O: the
scheduler sends the keeps and releases this returns.

With replicas of a stage (services/gateway/engine/chains.py) "every stage" is every stage of one chain: a prefix is
kept on the chain its sequence ran on (CachedPrefix.chain), a lookup can ask for one chain's, and the loss of an
instance forgets the prefixes kept through it (forget_chains)."""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from shared.batch.sampling import TopLogprobs

BLOCK_TOKENS = 16  # the unit of reuse: a prefix is reused in whole blocks (vLLM's default block size)


@dataclass
class CachedPrefix:
    seq_id: str  # the finished sequence every stage keeps
    hashes: list[bytes]  # chained hash of each full block of the tokens whose K/V it holds
    positions: int  # the positions whose K/V it holds (what its KV rows take on the stages; >= tokens)
    prompt_blocks: int = 0  # how many of its blocks are wholly its request's prompt (the rest hold generated tokens)
    chain: tuple[str, ...] = ()  # the instances after the first range that hold it (ChainTable.key; () without a table)

    @property
    def tokens(self) -> int:
        return len(self.hashes) * BLOCK_TOKENS


@dataclass(frozen=True)
class Hit:
    prefix: CachedPrefix
    tokens: int  # positions [0, tokens) of the new sequence come from the prefix (a multiple of BLOCK_TOKENS)


@dataclass
class PrefixStats:
    lookups: int = 0  # sequences admitted with the cache on
    hits: int = 0  # ... that attached a prefix
    cached_tokens: int = 0  # prompt tokens those hits did not compute
    kept: int = 0  # finished sequences kept as prefixes
    evicted: int = 0  # prefixes released for room
    misses: int = 0  # prefixes a stage no longer had (prefix_miss)
    audits: int = 0  # hits checked against a recompute (--prefix-cache-audit)
    audit_mismatches: int = 0  # ... whose outputs differed beyond the audit's tolerance
    audit_skipped: int = 0  # ... that could not be compared (the twin found no prefix, or failed)


class PrefixIndex:
    """identity: what the K/V depends on besides the tokens -- the model fingerprint, the layer split, dtype, weights
    mode and each stage's incarnation (Pipeline.cache_identity); it roots every hash chain, and a new identity
    empties the index."""

    def __init__(self, identity: str = ""):
        self._prefixes: OrderedDict[str, CachedPrefix] = OrderedDict()  # seq_id -> prefix, least recently used first
        self._holders: dict[bytes, set[str]] = {}  # block hash -> prefixes holding that block (and all before it)
        self.stats = PrefixStats()  # kept across reset()
        self.reset(identity)

    def __len__(self) -> int:
        return len(self._prefixes)

    @property
    def cached_tokens(self) -> int:
        """Tokens the kept prefixes can give (whole blocks)."""
        return sum(p.tokens for p in self._prefixes.values())

    @property
    def held_positions(self) -> int:
        """Positions the kept prefixes hold on every stage (what --prefix-cache-memory bounds)."""
        return sum(p.positions for p in self._prefixes.values())

    def reset(self, identity: str) -> list[str]:
        """Forget everything (the pipeline changed); returns the kept sequences to release on the stages."""
        dropped = list(self._prefixes)
        self.identity = identity
        self._root = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self._prefixes.clear()
        self._holders.clear()
        return dropped

    def chain(self, ids: list[int], tenant: str = "") -> list[bytes]:
        """The chained hash of each full block of ids: hash i covers ids[:BLOCK_TOKENS * (i + 1)]. A tenant roots
        its own chains (Request.cache_tenant): the same tokens of two tenants share no hash, so no lookup of one can
        find, or time, the other's prefixes; "" is the shared tenant."""
        h = self._root if not tenant else hashlib.blake2b(self._root + b"tenant\0" + tenant.encode(),
                                                          digest_size=16).digest()
        out = []
        for i in range(len(ids) // BLOCK_TOKENS):
            block = array("q", ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
            h = hashlib.blake2b(h + block.tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, ids: list[int], tenant: str = "", on: tuple[str, ...] | None = None) -> Hit | None:
        """The longest indexed prefix of ids that leaves at least one token to compute (the last prompt token's
        logits give the first output token), among those kept on the chain `on` (None: on any); None when no full
        block matches. Counted by count()."""
        best = None
        for i, h in enumerate(self.chain(ids[:-1], tenant)):
            holders = self._holders.get(h, set())
            if on is not None:
                holders = {s for s in holders if self._prefixes[s].chain == on}
            if not holders:
                break
            best = (i + 1, holders)
        if best is None:
            return None
        blocks, holders = best
        seq_id = next(s for s in reversed(self._prefixes) if s in holders)  # the most recently used holder
        self._prefixes.move_to_end(seq_id)
        return Hit(self._prefixes[seq_id], blocks * BLOCK_TOKENS)

    def matched(self, ids: list[int], tenant: str = "") -> int:
        """The tokens lookup(ids) would reuse, without touching the recency order (what routing compares)."""
        blocks = 0
        for h in self.chain(ids[:-1], tenant):
            if not self._holders.get(h):
                break
            blocks += 1
        return blocks * BLOCK_TOKENS

    def count(self, hit: Hit | None) -> None:
        """A sequence was admitted with this lookup's outcome."""
        self.stats.lookups += 1
        if hit is not None:
            self.stats.hits += 1
            self.stats.cached_tokens += hit.tokens

    def insert(self, seq_id: str, ids: list[int], pinned: set[str] = frozenset(),
               prompt_tokens: int = 0, tenant: str = "", chain: tuple[str, ...] = ()) -> tuple[bool, list[str]]:
        """A finished sequence whose K/V covers ids (every stage of `chain` holds those positions), the first
        prompt_tokens of them its prompt. What follows compares it with the prefixes kept on the same chain only (one
        on another chain serves no lookup there). Returns (keep it, prefixes to release): it is not kept when it holds no full block or an
        indexed prefix already holds all of its blocks. Released, except pinned ones (an admitted sequence is about
        to attach them): kept prefixes it wholly contains (it serves every lookup they would). Those whose prompt's
        whole blocks it holds go first in the eviction order instead: the conversation moved on, its next turn came
        back with other tokens than the ones generated (a client's re-tokenized or edited reply), and only their
        tail would be lost. Least recently used, each turn of such a chat would keep a KV row ahead of a shared
        system prompt's prefixes, which the rows limit then gave up first. (Not released at once: the new one maps
        their pages, and releasing a lender copies them.)"""
        hashes = self.chain(ids, tenant)
        if not hashes:
            return False, []
        covering = [s for s in self._holders.get(hashes[-1], ()) if self._prefixes[s].chain == chain]
        if covering:
            self._prefixes.move_to_end(covering[0])
            return False, []
        mine = set(hashes)
        here = [p for p in self._prefixes.values() if p.chain == chain]
        contained = [p for p in here if p.hashes[-1] in mine and p.seq_id not in pinned]
        for p in contained:
            self._forget(p.seq_id)
        superseded = [p.seq_id for p in self._prefixes.values() if p.chain == chain and p.prompt_blocks > 0
                      and p.hashes[p.prompt_blocks - 1] in mine]
        for s in reversed(superseded):
            self._prefixes.move_to_end(s, last=False)
        prompt_blocks = min(len(hashes), prompt_tokens // BLOCK_TOKENS)
        self._prefixes[seq_id] = CachedPrefix(seq_id, hashes, len(ids), prompt_blocks, chain)
        for h in hashes:
            self._holders.setdefault(h, set()).add(seq_id)
        self.stats.kept += 1
        return True, [p.seq_id for p in contained]

    def evict(self, pinned: set[str] = frozenset()) -> str | None:
        """Drop the least recently used prefix not in pinned; returns its sequence id to release (None: none)."""
        victim = next((s for s in self._prefixes if s not in pinned), None)
        if victim is not None:
            self._forget(victim)
            self.stats.evicted += 1
        return victim

    def forget_chains(self, gone) -> list[str]:
        """Forget the prefixes kept on a chain for which gone(chain) is true (an instance of it was lost: their K/V
        there went with it); returns them, to release where the rest of their chain still holds them."""
        dropped = [s for s, p in self._prefixes.items() if gone(p.chain)]
        for s in dropped:
            self._forget(s)
        return dropped

    def discard(self, seq_id: str) -> None:
        """A stage no longer keeps it (prefix_miss): forget it; the caller releases it everywhere else."""
        if seq_id in self._prefixes:
            self._forget(seq_id)
            self.stats.misses += 1

    def _forget(self, seq_id: str) -> None:
        prefix = self._prefixes.pop(seq_id)
        for h in prefix.hashes:
            holders = self._holders[h]
            holders.discard(seq_id)
            if not holders:
                del self._holders[h]

    def info(self) -> dict:
        s = self.stats
        return {"block_tokens": BLOCK_TOKENS, "prefixes": len(self), "cached_tokens": self.cached_tokens,
                "held_positions": self.held_positions,
                "lookups": s.lookups, "hits": s.hits, "hit_rate": round(s.hits / s.lookups, 4) if s.lookups else None,
                "reused_tokens": s.cached_tokens, "kept": s.kept, "evicted": s.evicted, "misses": s.misses,
                "audits": s.audits, "audit_mismatches": s.audit_mismatches}


# ---- the audit: a hit checked against a recompute -----------------------------------------------------------------

AUDIT_TOP = 5  # the most likely next tokens whose log-probabilities the audit compares


@dataclass(frozen=True)
class AuditTolerance:
    """How far a recompute may move the top alternatives: their logprobs, or (`probabilities`) their probabilities --
    for stages that round activations, which move an unlikely alternative's logprob far (8-bit activations: by 1.15
    at p ~ 0.002) and its probability little. 0: the very same logprobs."""

    value: float
    probabilities: bool = False

    def difference(self, a: dict[int, float], b: dict[int, float]) -> float:
        """The largest difference between the tokens a and b share (token -> logprob); inf when they share none."""
        of = math.exp if self.probabilities else float
        return max((abs(of(a[t]) - of(b[t])) for t in a.keys() & b.keys()), default=math.inf)

    def __str__(self) -> str:
        return f"{self.value:g} of {'probabilities' if self.probabilities else 'logprobs'}"


@dataclass(eq=False)
class PrefixAudit:
    """One cache hit checked live, as `stagemesh trace` checks a deployment: two one-token twins of the request's
    prompt, greedy with the top AUDIT_TOP logprobs -- `cached` starts from a cached prefix like the request, `full`
    computes everything -- and the last stage's outputs compared. A stage whose kept K/V went wrong (a bug, a
    bit-flip, a slot reused too early) makes the two differ; nothing else should, beyond the stages' rounding
    (`tolerance`: services.gateway.engine.audit.audit_tolerance; 0 for batch-invariant stages)."""

    request_id: str
    prefix_tokens: int  # what the request's hit reused
    tolerance: AuditTolerance
    cached_id: str = ""
    full_id: str = ""
    results: dict[str, tuple[int, TopLogprobs | None]] = field(default_factory=dict)  # twin id -> (cached tokens, top)

    def compare(self) -> tuple[bool, float, str] | None:
        """(the outputs agree, the largest difference, a line saying how) once both twins answered; None when they
        cannot be compared (one failed, or the cached twin found no prefix to start from)."""
        (cached_tokens, a), (_, b) = self.results[self.cached_id], self.results[self.full_id]
        if not a or not b or cached_tokens == 0:
            return None
        la, lb = dict(a), dict(b)
        diff = self.tolerance.difference(la, lb)
        if self.tolerance.value == 0:
            agree = la == lb  # the very same alternatives and logprobs
        else:
            # each side's top token among the other's alternatives, every shared one within tolerance: a near-tie
            # that rounding turned the other way agrees, a different distribution does not
            agree = a[0][0] in lb and b[0][0] in la and diff <= self.tolerance.value
        what = "probabilities" if self.tolerance.probabilities else "logprobs"
        return agree, diff, (f"from {cached_tokens} cached tokens the top token is {a[0][0]}, recomputed {b[0][0]}; "
                             f"top-{len(a)} {what} differ by up to {diff:.3g} (tolerance {self.tolerance})")
