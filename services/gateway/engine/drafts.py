"""One request's drafting state (RequestDrafts, below the request that carries it): where its drafts come from (its
client's prediction, PredictionIndex; its own context, ContextIndex), how long the next may be (DraftBudget) and how
its drafts fared. The drafter shared by every request -- the pool, the measured pass costs and the policy that decides
when and how much to draft -- is services/gateway/engine/speculator.py, above the request."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

DRAFT_TOKENS = 6  # tokens a first draft proposes (a step then verifies DRAFT_TOKENS + 1 positions)
MAX_DRAFT_TOKENS = 12  # ... and a draft at most, after drafts that all stood
SKIP_STEPS = 8  # after a draft of one token that did not stand: steps without drafting before trying again
MATCH_TOKENS = 4  # the longest output suffix looked up in the prediction (down to 1)
MAX_PREDICTED_TOKENS = 16  # a prediction's draft at most: one that all stood doubles the next, up to this
RECENT = 0.8  # a source's first-token hits and misses fade by this much at each of its later drafts
CONTEXT_MATCH = (4, 2)  # the longest and shortest suffix of a request's tokens looked up earlier in them



def _find(data: bytes, pattern: bytes, lo: int, hi: int) -> int:
    """The first token-aligned byte offset where pattern (int32 tokens) occurs within data[lo:hi]; -1 when none."""
    at = data.find(pattern, lo, hi)
    while at >= 0 and at % 4:  # a match across token boundaries: look further on
        at = data.find(pattern, at + 1, hi)
    return at


def _rfind(data: bytes, pattern: bytes, hi: int) -> int:
    """The last token-aligned byte offset where pattern occurs within data[:hi]; -1 when none."""
    at = data.rfind(pattern, 0, hi)
    while at >= 0 and at % 4:
        at = data.rfind(pattern, 0, at + len(pattern) - 1)
    return at


class PredictionIndex:
    """A request's prediction (OpenAI's Predicted Outputs: the text it expects, e.g. the file being edited) and where
    in it the output is. A draft is what follows, in the prediction, the longest suffix (MATCH_TOKENS down to 1) of
    the output found in it: the occurrence nearest the place the output was expected to reach (`expected`), the one
    ahead on a tie -- an edit that repeats a line keeps to its place, and a one-token suffix after a change re-joins
    the prediction where the output left it, not at the first token alike. Searched by bytes.find / rfind over the
    tokens as int32 bytes (C speed at thousands of tokens)."""

    def __init__(self, ids: Sequence[int]):
        self.ids = list(ids)
        self._bytes = array("i", self.ids).tobytes()
        self.expected: int | None = None  # the index in ids of the token the output's next one is expected to be
        self.start: int | None = None  # where in ids the draft in flight starts
        self.matched = 0  # the output suffix's tokens that located the latest draft (0: none located)

    def draft(self, output: Sequence[int], size: int, shortest: int = 1) -> list[int]:
        """Up to `size` tokens that follow the output in the prediction; [] when no suffix of it (of `shortest` tokens
        at least) occurs there with a token after it."""
        start = self._locate(output, shortest)
        self.start = start
        return [] if start is None else self.ids[start:start + size]

    def _locate(self, output: Sequence[int], shortest: int) -> int | None:
        hint = len(output) if self.expected is None else self.expected
        for n in range(min(MATCH_TOKENS, len(output)), shortest - 1, -1):
            pattern = array("i", output[-n:]).tobytes()
            last = 4 * (len(self.ids) - 1)  # an occurrence ends before the prediction's last token: one follows it
            ahead = _find(self._bytes, pattern, 4 * max(0, hint - n), last)  # ending at or after the hint
            behind = _rfind(self._bytes, pattern, max(0, min(last, 4 * (hint - 1))))  # ending before it
            ends = [at // 4 + n for at in (ahead, behind) if at >= 0]
            if ends:
                self.matched = n
                return min(ends, key=lambda end: (abs(end - hint), end < hint))
        self.matched = 0
        return None

    def stepped(self, drafted: int, stood: int) -> None:
        """The step came back with `stood` of `drafted` drafted tokens of the prediction standing (drafted 0: its
        draft came from elsewhere, `stood` of it standing), and one sampled token after them: the output is expected
        to go on where the prediction does after that token."""
        if drafted and self.start is not None:
            self.expected = self.start + stood + 1
        elif self.start is not None:  # a place found but no draft sent (the costs cut it): one token on from there
            self.expected = self.start + 1
        elif self.expected is not None:  # no place found: the output moved on by what the step produced
            self.expected += 1 + stood
        self.start = None


class ContextIndex:
    """One sequence's tokens as int32 bytes, extended as it grows, searched from the end by bytes.rfind (C speed, a
    few µs at thousands of tokens, 4 bytes a token)."""

    def __init__(self):
        self._bytes = bytearray()
        self._tokens = 0

    def draft(self, ids: Sequence[int], size: int) -> list[int]:
        """The `size` tokens (fewer at the end) that followed the most recent earlier occurrence of the longest
        suffix of `ids` (CONTEXT_MATCH tokens, down to its shortest) that has a token after it; [] when none occurs.
        `ids` only ever grows between calls (a sequence's prompt + output)."""
        if len(ids) > self._tokens:
            self._bytes += array("i", ids[self._tokens:]).tobytes()
            self._tokens = len(ids)
        longest, shortest = CONTEXT_MATCH
        for n in range(min(longest, len(ids) - 1), shortest - 1, -1):
            tail = self._bytes[-4 * n:]
            end = 4 * (len(ids) - 1)  # an occurrence ends before the newest token: at least one token follows it
            at = self._bytes.rfind(tail, 0, end)
            while at > 0 and at % 4:  # a match across token boundaries: look further back
                at = self._bytes.rfind(tail, 0, at + 4 * n - 1)
            if at >= 0 and at % 4 == 0:
                start = at // 4 + n
                return list(ids[start:start + size])
        return []




@dataclass
class DraftBudget:
    """How long a request's next draft may be, from how its last ones fared: a draft that all stood grows the next by
    2 (up to MAX_DRAFT_TOKENS), one that stood in part sizes the next to what stood + 1, one that did not stand at all
    halves it; at 0, SKIP_STEPS steps go without a draft (their rows would be wasted), then one token is tried.
    A prediction that the output left costs a few rows now and then, not a row per position.
    A prediction's budget (predicted) doubles after a draft that all stood, up to MAX_PREDICTED_TOKENS, and never
    pauses: an edit's output keeps to its prediction for long runs between changes, and re-joins it after each.
    (benchmarks/prediction.py; an offline replay of greedy edit answers chose these rules.)"""

    size: int = DRAFT_TOKENS
    skip: int = 0  # steps left without drafting
    predicted: bool = False

    def next_size(self) -> int:
        if self.skip:
            self.skip -= 1
            return 0
        return self.size

    def update(self, drafted: int, stood: int) -> None:
        if not drafted:
            return
        if stood == drafted:
            self.size = min(MAX_PREDICTED_TOKENS, 2 * drafted) if self.predicted else min(MAX_DRAFT_TOKENS, drafted + 2)
        elif stood or self.predicted:
            self.size = stood + 1
        else:
            self.size = drafted // 2
            if self.size == 0:
                self.size, self.skip = 1, SKIP_STEPS


@dataclass
class RequestDrafts:
    """One request's drafting state: its budget, its context index (made at its first n-gram draft), the source of
    its draft in flight, and how much of its output the pool has seen."""

    budget: DraftBudget = field(default_factory=DraftBudget)
    prediction: PredictionIndex | None = None  # its prediction's (made at its first draft), where it has one
    context: ContextIndex | None = None
    salt: int | None = None  # its tenant's pool key (tenant_salt), once needed
    source: str | None = None  # where the draft of its step in flight came from
    pooled: int = 0  # tokens of prompt + output whose n-grams the pool has taken (from its prompt's end on)
    prediction_stood: int = 0  # its prediction's drafted tokens that stood, and not (its usage)
    prediction_rejected: int = 0
    stood: int = 0  # its drafted tokens that stood ...
    missed: int = 0  # ... and its drafts that ended at a token that did not
    # a prediction's drafts stand in runs (the output keeps to the text for a while, then changes something), not
    # token by token alike: their first token's chance depends on how well the draft was located, the later ones'
    # on the run going on. Counted apart: the first drafted token's [stood, missed] by `located` (the output suffix's
    # tokens that found the draft in the prediction, 0 for a draft from the request's context), and the later ones'
    first_stood: dict[int, list[int]] = field(default_factory=dict)
    later: list[int] = field(default_factory=lambda: [0, 0])
    located: int = 0  # the draft in flight's
    # where a request with a prediction could draft from at its step in flight (source -> that source's draft), and
    # per source how often its draft's first token was the token that came: learnt from every candidate, the one sent
    # and the ones not (what came is known once the step is back), so the choice between them follows this
    # request's own output -- where the output keeps to the prediction, the prediction; where it changes the text in
    # the same way again and again (a rename), its own context
    candidates: dict[str, list[int]] = field(default_factory=dict)
    first_hits: dict[str, list[float]] = field(default_factory=dict)  # source -> [came, did not], fading

    @property
    def acceptance(self) -> float:
        """The chance its next drafted token stands, from its own drafts (one stood and one missed assumed first)."""
        return (self.stood + 1) / (self.stood + self.missed + 2)

    def first_chance(self, located: int) -> float:
        """The chance a prediction draft's first token stands, located by that many tokens (one stood and one missed
        assumed first)."""
        stood, missed = self.first_stood.get(located, (0, 0))
        return (stood + 1) / (stood + missed + 2)

    @property
    def later_chance(self) -> float:
        """The chance a prediction draft's next token stands once the ones before it stood."""
        return (self.later[0] + 1) / (sum(self.later) + 2)

    def first_hit_chance(self, source: str) -> float:
        """The chance the source's next draft starts with the token that comes, from its latest drafts (RECENT: the
        older ones fade; one hit and one miss assumed first)."""
        came, missed = self.first_hits.get(source, (0, 0))
        return (came + 1) / (came + missed + 2)

    def learn_candidates(self, new: Sequence[int]) -> None:
        """The step in flight came back with `new` (its drafted tokens that stood and the token sampled after them):
        count, for each source that had a draft, whether that draft's first token came."""
        for source, draft in self.candidates.items():
            if draft and new:
                hits = self.first_hits.setdefault(source, [0.0, 0.0])
                hits[:] = [RECENT * h for h in hits]
                hits[0 if draft[0] == new[0] else 1] += 1
        self.candidates = {}

    def record(self, drafted: int, stood: int) -> None:
        """A draft of `drafted` tokens came back with `stood` of them standing."""
        self.stood += stood
        self.missed += stood < drafted
        if self.prediction is not None:
            self.first_stood.setdefault(self.located, [0, 0])[0 if stood else 1] += 1
            if stood:
                self.later[0] += stood - 1
                self.later[1] += stood < drafted
