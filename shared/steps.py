"""InferenceStep: what one sequence does in one micro-batch. Code asks the step, never `len(tokens) == 1`."""

from __future__ import annotations

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


@dataclass(frozen=True)
class Decode:
    """One generated token at current_position (the token's own position)."""

    current_position: int

    def __post_init__(self):
        if self.current_position < 1:
            raise ValueError(f"decode position must be >= 1 (a prompt comes first), got {self.current_position}")

    num_tokens = 1
    attach = None  # a decode never starts a sequence, so never from a cached prefix
    starts_sequence = False
    produces_token = True

    @property
    def start_position(self) -> int:
        return self.current_position


InferenceStep = Union[Prefill, Decode]


def chunk_prompt(total: int, chunk_size: int, start: int = 0) -> list[Prefill]:
    """Cut prompt positions [start, total) into Prefill chunks of at most chunk_size tokens."""
    chunks = []
    pos = start
    while pos < total:
        n = min(chunk_size, total - pos)
        chunks.append(Prefill(n, pos, total, pos + n == total))
        pos += n
    return chunks
