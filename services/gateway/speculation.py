"""Drafts for a sequence's next decode step, verified in that step (several positions a step: shared/batch/steps.py,
SequenceState.take). One source so far: the client's own `prediction` (OpenAI's Predicted Outputs: the text it
expects, e.g. the file being edited). The draft is what the prediction says comes next after the newest output
tokens; a wrong draft costs only the rows it added to one pass, never a different token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DRAFT_TOKENS = 6  # tokens a first draft proposes (a step then verifies DRAFT_TOKENS + 1 positions)
MAX_DRAFT_TOKENS = 12  # ... and a draft at most, after drafts that all stood
SKIP_STEPS = 8  # after a draft of one token that did not stand: steps without drafting before trying again
MATCH_TOKENS = 3  # the longest output suffix looked up in the prediction (down to 1)


def predicted_draft(prediction: Sequence[int], output: Sequence[int], size: int = DRAFT_TOKENS) -> list[int]:
    """The tokens that follow, in `prediction`, the longest suffix (MATCH_TOKENS down to 1) of `output` found in it
    -- its last occurrence before the output's length, so an edit that repeats a line keeps to the place it is at;
    [] when no suffix occurs."""
    for n in range(min(MATCH_TOKENS, len(output)), 0, -1):
        tail = list(output[-n:])
        # where the prediction holds the tail, nearest the output's own place first (outputs mostly follow it)
        limit = min(len(prediction) - n, len(output) + len(prediction) // 4)
        for start in range(limit, -1, -1):
            if list(prediction[start:start + n]) == tail:
                follow = list(prediction[start + n:start + n + size])
                if follow:
                    return follow
    return []


@dataclass
class DraftBudget:
    """How long a request's next draft may be, from how its last ones fared: a draft that all stood grows the next by
    2 (up to MAX_DRAFT_TOKENS), one that stood in part sizes the next to what stood + 1, one that did not stand at all
    halves it; at 0, SKIP_STEPS steps go without a draft (their rows would be wasted), then one token is tried.
    A prediction that the output left costs a few rows now and then, not a row per position."""

    size: int = DRAFT_TOKENS
    skip: int = 0  # steps left without drafting

    def next_size(self) -> int:
        if self.skip:
            self.skip -= 1
            return 0
        return self.size

    def update(self, drafted: int, stood: int) -> None:
        if not drafted:
            return
        if stood == drafted:
            self.size = min(MAX_DRAFT_TOKENS, drafted + 2)
        elif stood:
            self.size = stood + 1
        else:
            self.size = drafted // 2
            if self.size == 0:
                self.size, self.skip = 1, SKIP_STEPS
