"""KV cache owned by the runtime, never by the model: fixed slots, one per live sequence -- or per cached prefix: a
finished sequence the gateway asked the stage to keep, whose K/V a later sequence with the same prefix starts from.

On Linux CPUs a sequence that starts from a cached prefix shares the prefix's memory pages instead of copying them
(shared.models.kv_pages.SharedPages: vAttention's idea, virtual memory instead of a paged attention kernel): its row's pages for the prefix
are mapped onto the kept row's, so 32 conversations on one system prompt hold that prompt's K/V once, and attention
still reads every row in place as one tensor."""

from __future__ import annotations

import heapq
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Hashable

import torch

from shared.batch.layout import BatchLayout
from shared.errors import BadBatch, KVCacheFull, PrefixMiss, UnknownSequence
from shared.models.kv_pages import SharedPages, process_map_budget

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
    gateway, which applies the same bounds to its index, learns of any other loss from a prefix_miss.

    live_bytes: the K/V the live sequences may take of their own (the stage's memory budget less its weights and the
    kept prefixes' bound; None: no bound). The gateway admits requests by it (StageInfo.live_positions); a
    micro-batch that starts a sequence past it is refused here with kv_full (check_room), so a gateway that does not
    know of it (another one, a stale view) is held back before the OS kills the stage for memory.

    On a CPU (Linux), the tensors' memory is SharedPages': a sequence that attaches a kept prefix maps its row's
    whole pages onto the prefix's, and the byte counts below count such a page once (shared_bytes: the rest)."""

    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", scratch: bool = False, prefix_slots: int = 0,
                 prefix_bytes: int | None = None, live_bytes: int | None = None):
        rows = num_slots + prefix_slots
        self.scratch_slot = rows if scratch else None
        shape = (rows + int(scratch), num_kv_heads, max_seq_len, head_dim)
        # zeros, not empty: masked positions are still multiplied by 0 in attention, and 0 * NaN is NaN. On a CPU,
        # memory that is committed as it is written (a memfd's pages read as zeros until then; SharedPages), so a
        # stage's resident KV memory follows the tokens its sequences hold, not slots x max_seq_len.
        self._pages = None
        if torch.device(device).type == "cpu" and hasattr(os, "memfd_create"):  # Linux
            self._pages = SharedPages([shape] * (2 * num_layers), dtype, process_map_budget())
            self.k, self.v = self._pages.tensors[:num_layers], self._pages.tensors[num_layers:]
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = self.k[0].device
        self.slot_bytes = math.prod(shape[1:]) * dtype.itemsize  # one slot's row of one tensor
        self.position_bytes = position_bytes(num_layers, num_kv_heads, head_dim, dtype)
        self.num_slots = num_slots  # live sequences at once
        self.prefix_slots = prefix_slots  # rows beyond those, for cached prefixes
        self.prefix_bytes = prefix_bytes  # K/V the kept prefixes may hold (None: as much as their rows take)
        self.live_bytes = live_bytes  # K/V the live sequences may take of their own (None: as much as their rows take)
        self.max_seq_len = max_seq_len
        self._free: list[int] = list(range(rows))  # a min-heap: the lowest free slot is handed out first, so
        # live sequences stay packed at the bottom and batched decode can read them as one slice (DecodeWindow; where
        # they are not, a slice per run of them: SplitDecode)
        self._slot_of: dict[Hashable, int] = {}
        self._touched: dict[Hashable, float] = {}  # seq_id -> monotonic time its slot was last allocated or used
        self._kept: OrderedDict[Hashable, None] = OrderedDict()  # cached prefixes, least recently used first
        self.filled = [0] * rows  # per row: positions [0, filled) were written since it was handed out
        self.evicted = 0  # kept prefixes given up for a new sequence or for room under prefix_bytes

    def _forget(self, slot: int) -> None:
        """Give a freed slot's memory back to the OS (its pages read as zeros again, committed again when written)."""
        if self._pages is not None:
            self._pages.forget(slot)

    def _own_positions(self, slot: int) -> int:
        """Positions of the slot whose K/V takes memory of its own (not shared with a kept prefix's pages)."""
        shared = self._pages.shared_positions(slot) if self._pages is not None else 0
        return max(0, self.filled[slot] - shared)

    @property
    def reserved_bytes(self) -> int:
        """What every slot's K/V could take (the address space the tensors span)."""
        return sum(t.nbytes for t in self.k + self.v)

    @property
    def resident_bytes(self) -> int:
        """K/V memory the held slots' written positions take (what the OS has committed, to a page); positions
        shared with a kept prefix's pages count once."""
        # list(): /info and /metrics read these on the stage's loop while its compute thread may change the dicts
        return sum(self._own_positions(slot) for slot in list(self._slot_of.values())) * self.position_bytes

    @property
    def shared_bytes(self) -> int:
        """K/V the held slots read from kept prefixes' pages instead of copies of their own: memory sharing saves."""
        if self._pages is None:
            return 0
        return sum(min(self.filled[slot], self._pages.shared_positions(slot))
                   for slot in list(self._slot_of.values())) * self.position_bytes

    @property
    def kept_bytes(self) -> int:
        """K/V memory the kept prefixes take (bounded by prefix_bytes)."""
        slots = [self._slot_of.get(seq_id) for seq_id in list(self._kept)]
        return sum(self._own_positions(slot) for slot in slots if slot is not None) * self.position_bytes

    @property
    def live_resident_bytes(self) -> int:
        """K/V memory the live sequences (not the kept prefixes) take of their own."""
        return max(0, self.resident_bytes - self.kept_bytes)

    def check_room(self, layout: BatchLayout, starting: bool) -> None:
        """Refuse (KVCacheFull) a micro-batch that starts a sequence when the positions it writes would take the live
        sequences' own K/V past live_bytes. One that only continues running sequences always runs: they were admitted
        within the bound, and refusing them would leave nothing to finish and free memory."""
        if self.live_bytes is None or not starting:
            return
        growth = sum(max(0, start + n - self.filled[slot]) for slot, start, n in
                     zip(layout.slots, layout.starts, layout.lengths) if slot < len(self.filled))
        need = self.live_resident_bytes + growth * self.position_bytes
        if need > self.live_bytes:
            raise KVCacheFull(f"the live sequences' K/V would take {need / 2**20:.0f} MiB, past the "
                              f"{self.live_bytes / 2**20:.0f} MiB this stage's --memory-budget leaves them beside its "
                              "weights and --prefix-cache-memory; the gateway holds new requests until some finish")

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
            need = self._own_positions(self._slot_of[seq_id]) * self.position_bytes
            if need > self.prefix_bytes:
                log.info("did not keep %r as a cached prefix: its %d bytes of K/V are past the bound of %d "
                         "(--prefix-cache-memory)", seq_id, need, self.prefix_bytes)
                self.release(seq_id)
                return False
            while self._kept and self.kept_bytes + need > self.prefix_bytes:
                self._give_up_oldest("for room under --prefix-cache-memory")
        slot, top = self._slot_of[seq_id], max(self._free, default=-1)
        n = self.filled[slot]
        if top > slot:
            self._free.remove(top)
            pages = self._pages
            moved = pages.lend(top, slot, n, own=False) if pages is not None else 0  # the pages it borrows
            if pages is not None:
                pages.publish(top)  # its own pages where later sequences can map them
            for cache in (*self.k, *self.v):
                cache[top, :, moved:n].copy_(cache[slot, :, moved:n])
            self.filled[top] = n
            self._slot_of[seq_id] = top
            self._forget(slot)
            self.filled[slot] = 0
            self._free.append(slot)
            heapq.heapify(self._free)
        elif self._pages is not None and self._pages.shareable:  # published where it is: its K/V saved around that
            first = self._pages.shared_positions(slot)
            saved = [cache[slot, :, first:n].clone() for cache in (*self.k, *self.v)]
            self._pages.publish(slot)
            for cache, data in zip((*self.k, *self.v), saved):
                cache[slot, :, first:n].copy_(data)
        self._touched.pop(seq_id, None)
        self._kept[seq_id] = None
        return True

    def attach(self, seq_id: Hashable, prefix_id: Hashable, length: int) -> None:
        """Start the (just allocated) sequence from the cached prefix `prefix_id`: its K/V at positions [0, length),
        whole pages shared with the prefix's where they can be (SharedPages.lend), the rest copied into the
        sequence's slot. PrefixMiss when this stage no longer keeps that prefix."""
        if prefix_id not in self._kept:
            raise PrefixMiss(f"cached prefix {prefix_id!r} is not kept on this stage (given up for room, or the stage "
                             "restarted); the gateway prefills the sequence in full")
        if length > self.max_seq_len:
            raise BadBatch(f"cached prefix of {length} tokens is past this stage's max_seq_len {self.max_seq_len}")
        self._kept.move_to_end(prefix_id)
        src, dst = self._slot_of[prefix_id], self._slot_of[seq_id]
        shared = self._pages.lend(dst, src, length) if self._pages is not None else 0
        for cache in (*self.k, *self.v):
            cache[dst, :, shared:length].copy_(cache[src, :, shared:length])
        self.filled[dst] = max(self.filled[dst], length)

    def adopt(self, seq_id: Hashable, k: list[torch.Tensor], v: list[torch.Tensor], kept: bool = False) -> None:
        """A sequence that arrives whole from another stage (a joiner given its layers' K/V: services/stage/
        membership.py): a slot of its own holding k[i], v[i] -- [kv_heads, n, head_dim], one per local layer -- at
        positions [0, n), live, or kept as a cached prefix. BadBatch when the shapes are not this cache's;
        KVCacheFull when no slot is free."""
        n = k[0].shape[1] if k else 0
        want = (self.k[0].shape[1], self.k[0].shape[3])
        if len(k) != len(self.k) or len(v) != len(self.v) or not 0 < n <= self.max_seq_len or any(
                t.dim() != 3 or t.dtype != self.k[0].dtype or (t.shape[0], t.shape[1], t.shape[2]) != (want[0], n, want[1])
                for t in (*k, *v)):
            raise BadBatch(f"the K/V of {seq_id!r} is not {len(self.k)} layers of {self.k[0].dtype} [{want[0]}, "
                           f"<= {self.max_seq_len}, {want[1]}] (one length for every layer)")
        slot = self.allocate(seq_id)
        for i in range(len(self.k)):
            self.k[i][slot, :, :n].copy_(k[i])
            self.v[i][slot, :, :n].copy_(v[i])
        self.filled[slot] = n
        if kept:
            self.keep(seq_id)

    def wrote(self, layout: BatchLayout) -> None:
        """A micro-batch wrote these positions (what keep() moves of a slot)."""
        for slot, start, n in zip(layout.slots, layout.starts, layout.lengths):
            if slot < len(self.filled):
                self.filled[slot] = max(self.filled[slot], start + n)

    def slot(self, seq_id: Hashable, holding: int = 0) -> int:
        """The live sequence's slot, which must hold its positions [0, holding) (a step continuing it from there);
        asking for it (a micro-batch computing the sequence) renews its lease. UnknownSequence otherwise: no slot,
        a finished sequence kept as a cached prefix, or fewer positions than the step continues from (a gateway
        re-adopting a sequence in place that this stage never finished prefilling) -- the gateway then replays it."""
        try:
            slot = self._slot_of[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id!r} has no KV slot on this stage: its first prefill chunk never reached it "
                                  "(or the stage restarted since, or its slot lease expired)") from None
        if seq_id in self._kept or (slot < len(self.filled) and self.filled[slot] < holding):
            raise UnknownSequence(f"sequence {seq_id!r} is not live on this stage from position {holding} (it holds "
                                  f"{self.filled[slot] if slot < len(self.filled) else 0} positions"
                                  f"{', kept as a cached prefix' if seq_id in self._kept else ''})")
        self._touched[seq_id] = time.monotonic()
        return slot

    def row_of(self, seq_id: Hashable) -> tuple[int, int]:
        """(slot, positions written) of a sequence the cache holds, live or kept, without touching its lease."""
        slot = self._slot_of[seq_id]
        return slot, self.filled[slot]

    def take_over(self, old: KVCache, layers: dict[int, int]) -> None:
        """This cache, new and empty, takes every sequence `old` holds (a stage's re-split: the same rows, a new range
        of layers): each one's slot, lease, written positions and kept-prefix standing, and the K/V of the layers
        both caches hold (`layers`: this cache's local layer -> old's), positions [0, written). The other layers'
        K/V the caller writes itself. Pages `old` shared between rows are copied here, each row its own."""
        if len(self.filled) != len(old.filled) or self.max_seq_len != old.max_seq_len \
                or self.k[0].shape[1:] != old.k[0].shape[1:] or self.k[0].dtype != old.k[0].dtype:
            raise ValueError("a KV cache takes over another's sequences only with the same rows, context, kv heads, "
                             "head dim and dtype")
        if self._slot_of:
            raise ValueError("take_over fills an empty KV cache")
        self._free = list(old._free)
        self._slot_of = dict(old._slot_of)
        self._touched = dict(old._touched)
        self._kept = OrderedDict(old._kept)
        self.filled = list(old.filled)
        self.evicted = old.evicted
        for slot in self._slot_of.values():
            n = self.filled[slot]
            for mine, theirs in layers.items():
                self.k[mine][slot, :, :n].copy_(old.k[theirs][slot, :, :n])
                self.v[mine][slot, :, :n].copy_(old.v[theirs][slot, :, :n])

    def untouched_since(self, cutoff: float) -> list[Hashable]:
        """Sequences whose slot has not been allocated or used since monotonic time `cutoff` (expired leases; kept
        prefixes have none)."""
        return [seq_id for seq_id, t in self._touched.items() if t < cutoff]

    @property
    def holders(self) -> list[Hashable]:
        return list(self._slot_of)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot_of

    def is_kept(self, seq_id: Hashable) -> bool:
        """A finished sequence kept as a cached prefix (not a live one)."""
        return seq_id in self._kept

    @property
    def used_slots(self) -> int:
        """Slots held by live sequences (kept prefixes not counted: kept_slots); at most num_slots."""
        return len(self._slot_of) - len(self._kept)

    @property
    def kept_slots(self) -> int:
        return len(self._kept)
