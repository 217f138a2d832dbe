"""Where each packed token of a micro-batch lives: its sequence's KV slot and position (what attention reads and
writes), laid out from the micro-batch's steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from shared.batch.steps import InferenceStep, decodes_only
from shared.errors import BadBatch


@dataclass
class BatchLayout:
    """Where each packed token of a micro-batch lives. Tokens of sequence i are rows
    [offsets[i], offsets[i] + lengths[i]) of the packed hidden state [N, D]."""

    slots: list[int]
    starts: list[int]  # position of each sequence's first token in this micro-batch
    lengths: list[int]  # tokens of each sequence in this micro-batch
    positions: torch.Tensor  # [N] int64 absolute position of every token
    token_slots: torch.Tensor  # [N] int64 KV slot of every token
    decode_only: bool  # every sequence contributes exactly one token (the batched-attention fast path)

    @cached_property
    def offsets(self) -> list[int]:
        out, acc = [], 0
        for n in self.lengths:
            out.append(acc)
            acc += n
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @classmethod
    def build(cls, slots: Sequence[int], steps: Sequence[InferenceStep], max_seq_len: int,
              device: torch.device | str = "cpu", positions_as_rows: bool = False) -> BatchLayout:
        """positions_as_rows: every step a Decode, each of a step's positions laid out as a one-token row of its
        own (the same slot, consecutive positions), so a several-position step computes exactly as that many
        one-token decode steps do: the decode kernels, the compiled graphs (their attention must read each row's
        own slot and context: KernelDecode, BatchDecode)."""
        if positions_as_rows:
            if not decodes_only(steps):
                raise BadBatch("positions are laid out as rows in a micro-batch of decodes only")
            slots = [slot for slot, s in zip(slots, steps) for _ in range(s.num_tokens)]
            starts = [s.start_position + i for s in steps for i in range(s.num_tokens)]
            lengths = [1] * len(starts)
        else:
            starts = [s.start_position for s in steps]
            lengths = [s.num_tokens for s in steps]
        for st, n in zip(starts, lengths):
            if st + n > max_seq_len:
                raise BadBatch(f"sequence reaches position {st + n}, past this stage's max_seq_len {max_seq_len}")
        decode_only = all(n == 1 for n in lengths)
        if decode_only:  # every step of a stream: two small tensors straight from the lists, no cat / arange
            positions, token_slots = torch.tensor(starts, dtype=torch.long), torch.tensor(list(slots), dtype=torch.long)
        else:
            positions = torch.cat([torch.arange(st, st + n) for st, n in zip(starts, lengths)])
            token_slots = torch.repeat_interleave(torch.tensor(list(slots)), torch.tensor(lengths))
        return cls(list(slots), starts, lengths, positions.to(device), token_slots.to(device), decode_only)
