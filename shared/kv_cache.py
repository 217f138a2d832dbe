"""KV cache owned by the runtime, never by the model: fixed slots, one per live sequence -- or per cached prefix: a
finished sequence the gateway asked the stage to keep, whose K/V a later sequence with the same prefix copies."""

from __future__ import annotations

import heapq
import logging
import math
import mmap
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from shared.errors import BadBatch, KVCacheFull, PrefixMiss, UnknownSequence
from shared.steps import InferenceStep

log = logging.getLogger("stagemesh.kv")


def position_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in a KV cache of num_layers layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class KVCache:
    """k, v: one tensor per local layer, each [rows (+1 scratch), kv_heads, max_seq_len, head_dim], rows = num_slots +
    prefix_slots. A sequence owns one row (its slot) from its first prefill chunk until it is released; at most
    num_slots sequences are live at once. (Separate tensors, not one [layers, ...] tensor: a compiled decode step
    writes each in place, where a view of a larger tensor would make inductor copy all of it back.)

    scratch: one more row, index `scratch_slot` = rows, that no sequence is ever given: a compiled decode step
    warming up in the background writes there while live sequences decode in the other rows.

    kept: finished sequences whose rows stay as cached prefixes (keep()). They have no lease; the gateway owns
    the index of what they hold and releases them itself. They live in the rows live sequences leave free: the
    prefix_slots rows beyond num_slots, which only kept prefixes need, and live ones' unused rows. Their K/V is
    bounded by `prefix_bytes`: keeping one past it gives up the least recently used others first. When a new
    sequence finds no free row, the least recently used kept one is given up. Both are counted in `evicted`; the
    gateway, which applies the same bounds to its index, learns of any other loss from a prefix_miss."""

    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", scratch: bool = False, prefix_slots: int = 0,
                 prefix_bytes: int | None = None):
        rows = num_slots + prefix_slots
        self.scratch_slot = rows if scratch else None
        shape = (rows + int(scratch), num_kv_heads, max_seq_len, head_dim)
        # zeros, not empty: masked positions are still multiplied by 0 in attention, and 0 * NaN is NaN.
        self._maps: list[mmap.mmap] = []  # on the CPU, each tensor's memory (see _lazy_zeros)
        self.k = [self._zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [self._zeros(shape, dtype, device) for _ in range(num_layers)]
        self.device = self.k[0].device
        self.slot_bytes = math.prod(shape[1:]) * dtype.itemsize  # one slot's row of one tensor
        self.position_bytes = position_bytes(num_layers, num_kv_heads, head_dim, dtype)
        self.num_slots = num_slots  # live sequences at once
        self.prefix_slots = prefix_slots  # rows beyond those, for cached prefixes
        self.prefix_bytes = prefix_bytes  # K/V the kept prefixes may hold (None: as much as their rows take)
        self.max_seq_len = max_seq_len
        self._free: list[int] = list(range(rows))  # a min-heap: the lowest free slot is handed out first, so
        # live sequences stay packed at the bottom and batched decode can read them as one slice (DecodeWindow; where
        # they are not, a slice per run of them: SplitDecode)
        self._slot_of: dict[Hashable, int] = {}
        self._touched: dict[Hashable, float] = {}  # seq_id -> monotonic time its slot was last allocated or used
        self._kept: OrderedDict[Hashable, None] = OrderedDict()  # cached prefixes, least recently used first
        self.filled = [0] * rows  # per row: positions [0, filled) were written since it was handed out
        self.evicted = 0  # kept prefixes given up for a new sequence or for room under prefix_bytes

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Zeros that take memory as they are written: on the CPU a private anonymous mapping, whose pages the OS commits
        on first write (a position's K/V lands on its own pages: [slot, head, position] rows are contiguous), so a
        stage's resident KV memory follows the tokens its sequences hold, not slots x max_seq_len. Decode attention
        reads the tensor in place as before."""
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        count = math.prod(shape)
        buf = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # 4 KiB pages even where transparent huge pages are "always": a
            buf.madvise(mmap.MADV_NOHUGEPAGE)  # 2 MiB page would commit a slot's neighbours' rows with its own
        self._maps.append(buf)
        return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)

    def _forget(self, slot: int) -> None:
        """Give a freed slot's memory back to the OS (its pages read as zeros again, committed again when written)."""
        if not self._maps:
            return
        start = -(-slot * self.slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the row only
        end = (slot + 1) * self.slot_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            for buf in self._maps:
                buf.madvise(mmap.MADV_DONTNEED, start, end - start)

    @property
    def reserved_bytes(self) -> int:
        """What every slot's K/V could take (the address space the tensors span)."""
        return sum(t.nbytes for t in self.k + self.v)

    @property
    def resident_bytes(self) -> int:
        """K/V memory the held slots' written positions take (what the OS has committed, to a page)."""
        return sum(self.filled[slot] for slot in self._slot_of.values()) * self.position_bytes

    @property
    def kept_bytes(self) -> int:
        """K/V memory the kept prefixes take (bounded by prefix_bytes)."""
        return sum(self.filled[self._slot_of[seq_id]] for seq_id in self._kept) * self.position_bytes

    def allocate(self, seq_id: Hashable) -> int:
        if seq_id in self._slot_of:
            raise BadBatch(f"sequence {seq_id!r} already holds KV slot {self._slot_of[seq_id]}")
        if self.used_slots >= self.num_slots:
            raise KVCacheFull(f"all {self.num_slots} KV slots are in use; release a sequence or raise --kv-slots")
        if not self._free and self._kept:
            self._give_up_oldest("for a new sequence: every KV row was in use")
        if not self._free:
            raise KVCacheFull(f"all {self.num_slots} KV slots are in use; release a sequence or raise --kv-slots")
        slot = heapq.heappop(self._free)
        self.filled[slot] = 0
        self._slot_of[seq_id] = slot
        self._touched[seq_id] = time.monotonic()
        return slot

    def release(self, seq_id: Hashable) -> bool:
        slot = self._slot_of.pop(seq_id, None)
        if slot is None:
            return False
        self._touched.pop(seq_id, None)
        self._kept.pop(seq_id, None)
        self._forget(slot)
        self.filled[slot] = 0
        heapq.heappush(self._free, slot)
        return True

    def _give_up_oldest(self, why: str) -> None:
        """Release the least recently used kept prefix (counted in `evicted`)."""
        oldest = next(iter(self._kept))
        log.info("gave up the cached prefix %r %s", oldest, why)
        self.release(oldest)
        self.evicted += 1

    def keep(self, seq_id: Hashable) -> bool:
        """The finished sequence's slot stays, as a cached prefix: no lease; released by the gateway or given up
        for room. False when the stage holds no slot for it, or its K/V alone is past prefix_bytes (then it is
        released); the least recently used kept prefixes are given up until it fits under prefix_bytes.

        A kept prefix moves to the highest free row, when there is one above it: live sequences take the lowest
        free rows, so they stay packed at the bottom, where batched decode reads them as one slice (DecodeWindow);
        kept prefixes scattered among them made that slice span every row."""
        if seq_id not in self._slot_of:
            return False
        if seq_id in self._kept:  # kept already: only its recency changes
            self._kept.move_to_end(seq_id)
            return True
        if self.prefix_bytes is not None:
            need = self.filled[self._slot_of[seq_id]] * self.position_bytes
            if need > self.prefix_bytes:
                log.info("did not keep %r as a cached prefix: its %d bytes of K/V are past the bound of %d "
                         "(--prefix-cache-memory)", seq_id, need, self.prefix_bytes)
                self.release(seq_id)
                return False
            while self._kept and self.kept_bytes + need > self.prefix_bytes:
                self._give_up_oldest("for room under --prefix-cache-memory")
        slot, top = self._slot_of[seq_id], max(self._free, default=-1)
        if top > slot:
            self._free.remove(top)
            n = self.filled[slot]
            for cache in (*self.k, *self.v):
                cache[top, :, :n].copy_(cache[slot, :, :n])
            self.filled[top] = n
            self._slot_of[seq_id] = top
            self._forget(slot)
            self.filled[slot] = 0
            self._free.append(slot)
            heapq.heapify(self._free)
        self._touched.pop(seq_id, None)
        self._kept[seq_id] = None
        return True

    def attach(self, seq_id: Hashable, prefix_id: Hashable, length: int) -> None:
        """Start the (just allocated) sequence from the cached prefix `prefix_id`: copy its K/V at positions
        [0, length) into the sequence's slot. PrefixMiss when this stage no longer keeps that prefix."""
        if prefix_id not in self._kept:
            raise PrefixMiss(f"cached prefix {prefix_id!r} is not kept on this stage (given up for room, or the stage "
                             "restarted); the gateway prefills the sequence in full")
        if length > self.max_seq_len:
            raise BadBatch(f"cached prefix of {length} tokens is past this stage's max_seq_len {self.max_seq_len}")
        self._kept.move_to_end(prefix_id)
        src, dst = self._slot_of[prefix_id], self._slot_of[seq_id]
        for cache in (*self.k, *self.v):
            cache[dst, :, :length].copy_(cache[src, :, :length])
        self.filled[dst] = max(self.filled[dst], length)

    def wrote(self, layout: BatchLayout) -> None:
        """A micro-batch wrote these positions (what keep() moves of a slot)."""
        for slot, start, n in zip(layout.slots, layout.starts, layout.lengths):
            if slot < len(self.filled):
                self.filled[slot] = max(self.filled[slot], start + n)
    def slot(self, seq_id: Hashable) -> int:
        """The sequence's slot; asking for it (a micro-batch computing the sequence) renews its lease."""
        try:
            slot = self._slot_of[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id!r} has no KV slot on this stage: its first prefill chunk never reached it "
                                  "(or the stage restarted since, or its slot lease expired)") from None
        self._touched[seq_id] = time.monotonic()
        return slot

    def untouched_since(self, cutoff: float) -> list[Hashable]:
        """Sequences whose slot has not been allocated or used since monotonic time `cutoff` (expired leases; kept
        prefixes have none)."""
        return [seq_id for seq_id, t in self._touched.items() if t < cutoff]

    @property
    def holders(self) -> list[Hashable]:
        return list(self._slot_of)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot_of

    @property
    def used_slots(self) -> int:
        """Slots held by live sequences (kept prefixes not counted: kept_slots); at most num_slots."""
        return len(self._slot_of) - len(self._kept)

    @property
    def kept_slots(self) -> int:
        return len(self._kept)


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
              device: torch.device | str = "cpu") -> BatchLayout:
        starts = [s.start_position for s in steps]
        lengths = [s.num_tokens for s in steps]
        for st, n in zip(starts, lengths):
            if st + n > max_seq_len:
                raise BadBatch(f"sequence reaches position {st + n}, past this stage's max_seq_len {max_seq_len}")
        decode_only = all(n == 1 for n in lengths)
        if decode_only:  # every step of a stream: two small tensors straight from the lists (~0.3 ms less a call)
            positions, token_slots = torch.tensor(starts, dtype=torch.long), torch.tensor(list(slots), dtype=torch.long)
        else:
            positions = torch.cat([torch.arange(st, st + n) for st, n in zip(starts, lengths)])
            token_slots = torch.repeat_interleave(torch.tensor(list(slots)), torch.tensor(lengths))
        return cls(list(slots), starts, lengths, positions.to(device), token_slots.to(device), decode_only)
