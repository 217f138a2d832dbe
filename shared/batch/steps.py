"""InferenceStep: what one sequence does in one micro-batch. Code asks the step, never `len(tokens) == 1`.

A step feeds num_tokens tokens at positions [start_position, start_position + num_tokens) and asks for `samples`
sampled tokens back: none for a prefill chunk that is not the prompt's last, one for the last chunk (the first
output token), one per position for a Decode -- the one newest token (k = 1), or the newest token and k - 1 drafted
ones, each position's next token sampled, so one pass can verify k - 1 drafts (SequenceState.take)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Prefill:
    """A chunk of the prompt: tokens [chunk_start_position, chunk_start_position + chunk_tokens).

    attach: a cached prefix -- the id of a sequence every stage keeps after it finished (the gateway's prefix cache)
    -- whose K/V at positions [0, chunk_start_position) this sequence starts from: the chunk is the sequence's
    first, its slot is allocated here and those positions copied in before the chunk computes."""

    chunk_tokens: int
    chunk_start_position: int
    total_prompt_tokens: int
    is_final_chunk: bool
    attach: str | None = None

    def __post_init__(self):
        if self.chunk_tokens < 1 or self.chunk_start_position < 0:
            raise ValueError(f"invalid prefill chunk {self}")
        if self.chunk_start_position + self.chunk_tokens > self.total_prompt_tokens:
            raise ValueError(f"prefill chunk {self} runs past the prompt")
        if self.is_final_chunk != (self.chunk_start_position + self.chunk_tokens == self.total_prompt_tokens):
            raise ValueError(f"prefill chunk {self}: is_final_chunk disagrees with the positions")
        if self.attach is not None and self.chunk_start_position == 0:
            raise ValueError(f"prefill chunk {self} attaches a cached prefix but starts at position 0")

    @property
    def num_tokens(self) -> int:
        return self.chunk_tokens

    @property
    def start_position(self) -> int:
        return self.chunk_start_position

    @property
    def starts_sequence(self) -> bool:
        """The first chunk of a sequence: the runtime allocates its KV slot here, exactly once."""
        return self.chunk_start_position == 0 or self.attach is not None

    @property
    def produces_token(self) -> bool:
        return self.is_final_chunk

    @property
    def samples(self) -> int:
        """Tokens sampled from this step: the last row of the prompt's final chunk, else none."""
        return 1 if self.is_final_chunk else 0


MAX_DECODE_TOKENS = 64  # query positions one Decode may carry (the newest token and up to 63 drafted ones)


@dataclass(frozen=True)
class Decode:
    """The newest generated token at current_position (its own position), followed by num_tokens - 1 drafted tokens
    at the positions after it; every one of the num_tokens positions has its next token sampled."""

    current_position: int
    num_tokens: int = 1

    def __post_init__(self):
        if self.current_position < 1:
            raise ValueError(f"decode position must be >= 1 (a prompt comes first), got {self.current_position}")
        if not 1 <= self.num_tokens <= MAX_DECODE_TOKENS:
            raise ValueError(f"a decode step carries 1..{MAX_DECODE_TOKENS} tokens, got {self.num_tokens}")

    attach = None  # a decode never starts a sequence, so never from a cached prefix
    starts_sequence = False
    produces_token = True

    @property
    def start_position(self) -> int:
        return self.current_position

    @property
    def samples(self) -> int:
        return self.num_tokens


InferenceStep = Union[Prefill, Decode]


def decodes_only(steps: Iterable[InferenceStep]) -> bool:
    """The rule of rows: a micro-batch of decodes only is the one kind whose several-position steps may be laid out as
    one-token rows (BatchLayout.build's positions_as_rows: each row computes as a one-token decode step does), and
    whose round trip prices a decode pass (the gateway's PassCosts)."""
    return all(isinstance(s, Decode) for s in steps)


def chunk_prompt(total: int, chunk_size: int, start: int = 0) -> list[Prefill]:
    """Cut prompt positions [start, total) into Prefill chunks of at most chunk_size tokens."""
    chunks = []
    pos = start
    while pos < total:
        n = min(chunk_size, total - pos)
        chunks.append(Prefill(n, pos, total, pos + n == total))
        pos += n
    return chunks
