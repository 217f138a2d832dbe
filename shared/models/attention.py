"""Attention, in one place: how a step's queries attend to the KV cache, and which way each kind of step takes.

Every strategy maps q [N, H, hd] -> [N, H, hd] against the cache rows k_cache / v_cache [slots, KVH, max_seq, hd],
read in place, and names where the step's own K/V rows go (token_slots, positions). choose_attention() picks one for an eager
step; the compiled steps (shared.models.compiled_decode) build their own, by the same table:

  step                          mode / where                               strategy           why
  ----------------------------  -----------------------------------------  -----------------  -------------------------
  a decode batch (1 token each)  float32 where the qdot kernels load (AVX2)  KernelDecode       each row reads exactly its
                                                                                                own context, once
  a decode batch                 bf16 / fp16, another CPU, a GPU             SplitDecode or     SDPA over one window of
                                                                             DecodeWindow       slots per run of them
  prefill chunks, k-token steps  any                                         ChunkAttention     causal over each
                                                                                                sequence's own positions
  any step                       --batch-invariant, float32 where the        ChunkAttention     every row on the decode
                                 qdot kernels load                           (rowwise, kernel)  kernel, in one call
  any step                       --batch-invariant, elsewhere                ChunkAttention     row by row: every row as
                                                                             (rowwise)          a decode computes it
  compiled, one sequence         --compile-decode                            OneSequenceDecode  sizes carried by tensor
                                                                                                lengths: one graph
  compiled, a decode batch       --compile-decode, KernelDecode's cover      BatchDecode        B the one dynamic size

A layer with an attention soft cap (gemma2) never takes the kernel: KernelDecode hands it to SplitDecode. Every
pair agrees within float rounding: tests/test_attention.py runs one matrix of them against each other."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from shared.batch.layout import BatchLayout
from shared.kernels import qdot
from shared.models.config import ModelConfig


@dataclass(frozen=True)
class Scores:
    """How a layer's q.k become attention weights."""

    scale: float | None = None  # None: 1/sqrt(head_dim)
    softcap: float = 0.0  # gemma2: scores -> softcap * tanh(scores / softcap) before the mask; 0: none
    window: int = 0  # a sliding-window layer: a query at position p sees keys (p - window, p]; 0: every earlier key


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Scores, mask: torch.Tensor | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention with how's scale and soft cap: q [B, H, T, hd], k / v [B, KVH, S, hd] ->
    [B, H, T, hd]; mask [.., T, S] boolean (True: visible) or additive. The window is the caller's mask. K/V kept in
    another dtype than q's (--kv-dtype float16 beside float32 activations) are widened to q's first."""
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if not how.softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=how.scale, enable_gqa=enable_gqa)
    if (group := q.shape[-3] // k.shape[-3]) > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = how.scale if how.scale is not None else q.shape[-1] ** -0.5
    s = torch.tanh(q.float() @ k.float().transpose(-1, -2) * (scale / how.softcap)) * how.softcap  # [B, H, T, S]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)


class Attention(Protocol):
    """Where a step's K/V rows go and how its queries attend: q [N, H, hd] -> [N, H, hd] against the cache (read in
    place). KernelDecode, or DecodeWindow / SplitDecode (batched decode), ChunkAttention (prefill chunks; the
    batch-invariant mode), OneSequenceDecode (the compiled one-sequence step)."""

    token_slots: torch.Tensor  # [N] int64: each token's KV slot
    positions: torch.Tensor  # [N] int64: each token's position
    traced: bool  # a compiled step's (OneSequenceDecode, BatchDecode): the step around it is traced, not run

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, how: Scores) -> torch.Tensor: ...


class LaidOut:
    """An attention whose tokens' KV slots and positions are its BatchLayout's (a dataclass field `layout`)."""

    layout: BatchLayout
    traced = False  # an eager step's

    @property
    def token_slots(self) -> torch.Tensor:
        return self.layout.token_slots

    @property
    def positions(self) -> torch.Tensor:
        return self.layout.positions


@dataclass
class ChunkAttention(LaidOut):
    """Each sequence's chunk attends causally to its own cached positions (sequence_attention); in
    the batch-invariant mode row by row, so every row computes as a decode step would: where the decode kernel
    applies (`kernel`: float32, qdot.cpp loads), every row of the step in one call of it -- row t of a chunk is
    a decode at position start + t, whose numbers never depend on the other rows -- and elsewhere (or on a
    soft-capped layer) one SDPA call per row (rowwise_attention), which made a long prompt cost one OpenMP
    region per token and layer."""

    layout: BatchLayout
    rowwise: bool
    kernel: bool = False  # rowwise rows on qdot.decode_attention_batch (float32 activations, the kernels load)

    @functools.cached_property
    def contexts(self) -> torch.Tensor:
        return self.layout.positions + 1  # [N] int64: row t attends to its sequence's positions 0..position

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, how: Scores) -> torch.Tensor:
        layout = self.layout
        if self.rowwise and self.kernel and not how.softcap:
            return kernel_attention(q, k_cache, v_cache, self.token_slots, self.contexts, how)
        one = self.rowwise_attention if self.rowwise else self.sequence_attention
        return torch.cat([one(q[o:o + ln], slot, start, ln, k_cache, v_cache, how)
                          for slot, start, ln, o in zip(layout.slots, layout.starts, layout.lengths, layout.offsets)])

    @classmethod
    def rowwise_attention(cls, q, slot, start, length, k_cache, v_cache, how: Scores = Scores()) -> torch.Tensor:
        """The batch-invariant mode's attention: each query row of a chunk computed exactly as a decode step
        computes it (one query over its `position + 1` keys), so a prompt prefilled in one pass, in chunks, or
        token by token -- and a sequence replayed after a failover -- gives the same numbers, bit for bit. One
        attention call per token: prefill pays for it, decode (length 1) does not."""
        return torch.cat([cls.sequence_attention(q[t:t + 1], slot, start + t, 1, k_cache, v_cache, how)
                          for t in range(length)])

    @staticmethod
    def sequence_attention(q, slot, start, length, k_cache, v_cache, how: Scores = Scores()) -> torch.Tensor:
        """A chunk of one sequence at positions [start, start+length): q [T, H, hd] -> [T, H, hd], causal, reading
        exactly the cached positions its queries can see, [first, start + length), in place (first: 0, or on a
        sliding layer the first query's oldest key). Also the batch-invariant decode path (T = 1)."""
        end = start + length
        first = max(0, start + 1 - how.window) if how.window else 0
        keys, values = k_cache[slot, :, first:end][None], v_cache[slot, :, first:end][None]  # [1, KVH, S, hd] views
        if length == 1:  # one query sees every key read: no mask
            return sdpa(q.transpose(0, 1)[None], keys, values, how, enable_gqa=True)[0].transpose(0, 1)
        query_pos = torch.arange(start, end, device=q.device)[:, None]
        key_pos = torch.arange(first, end, device=q.device)[None, :]
        mask = key_pos <= query_pos  # [T, S]
        if how.window:
            mask &= key_pos > query_pos - how.window
        out = sdpa(q.transpose(0, 1)[None], keys, values, how, mask, enable_gqa=True)
        return out[0].transpose(0, 1)


@dataclass
class OneSequenceDecode:
    """One sequence's decode step, for the compiled step: attention reads the slot's first C = position + 1 cached
    positions. The graph's two dynamic sizes are carried by tensors' lengths (shared.models.compiled_decode marks them
    dynamic), so one graph serves every position of every slot: `keys` is [C], and `slot_marker` is [slot + 2] (never
    read; + 2: dynamo treats sizes 0 and 1 as constants). With the slot a size, attention reads the slot's K/V as a
    slice of the cache, in place; indexed by a tensor they were gathered, a copy of the whole context per layer and
    step, a cost that grows with the context. Where the integer-dot kernels load (`kernel`, an AVX2 CPU), a float32
    layer without a soft cap attends with qdot.cpp's decode_attention, which reads each key and value row once
    (torch's SDPA read the cache slowly at one token: about half the step at a thousand
    positions), on a sliding layer only its window's. Elsewhere SDPA attends to all C keys, sliding-window layers
    hiding the keys before their window with an additive mask. benchmarks/decode_step.py --compile --context N
    measures the step at a given context."""

    token_slots: torch.Tensor  # [1] int64: the row the step's K/V is written to
    positions: torch.Tensor  # [1] int64
    keys: torch.Tensor  # [C] int64, 0..C-1: its length is the context the step attends to
    slot_marker: torch.Tensor  # [slot + 2], uninitialized: its length is the slot the step reads
    sliding_mask: torch.Tensor | None  # [1, 1, 1, C] 0 / -inf in the activation dtype (None: no key lies out of window)
    kernel: bool = False  # qdot.decode_attention where it applies (a constant of the graph)

    traced = True  # the compiled step's
    SLOT_OFFSET = 2  # slot_marker's length less the slot

    @classmethod
    def at(cls, slot: int, pos: int, config: ModelConfig, dtype: torch.dtype) -> OneSequenceDecode:
        keys = torch.arange(pos + 1)
        return cls(torch.tensor([slot]), torch.tensor([pos]), keys, torch.empty(slot + cls.SLOT_OFFSET, dtype=torch.uint8),
                   cls._sliding_mask(keys, pos, config, dtype), qdot.usable())

    @classmethod
    def called_directly(cls, token_slots: torch.Tensor, positions: torch.Tensor, pos: int, config: ModelConfig,
                        dtype: torch.dtype) -> OneSequenceDecode:
        """The step at() makes, for a compiled graph called without dynamo (compiled_decode.DirectCall): the graph takes
        the context and the slot as ints, so `keys` and `slot_marker` are left empty (attend, which reads their
        lengths, never runs on it), and the slot and position are the caller's [1] int64 tensors."""
        empty = torch.empty(0, dtype=torch.long)
        sliding = cls._sliding_mask(torch.arange(pos + 1), pos, config, dtype) if config.sliding_window else None
        return cls(token_slots, positions, empty, empty, sliding, qdot.usable())

    @staticmethod
    def _sliding_mask(keys: torch.Tensor, pos: int, config: ModelConfig, dtype: torch.dtype) -> torch.Tensor | None:
        """[1, 1, 1, C] 0 / -inf: the keys before the sliding window hidden (None: the model has no window). Always
        present on such a model, so the graph's inputs do not change with pos."""
        if not config.sliding_window:
            return None
        return torch.zeros(1, 1, 1, pos + 1, dtype=dtype).masked_fill_(keys <= pos - config.sliding_window, float("-inf"))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, how: Scores) -> torch.Tensor:
        _, h, hd = q.shape
        kvh, ctx = k_cache.shape[1], self.keys.shape[0]
        slot = self.slot_marker.shape[0] - self.SLOT_OFFSET
        if self.kernel and not how.softcap and q.dtype == torch.float32 and hd % 8 == 0:
            scale = how.scale if how.scale is not None else hd ** -0.5
            return qdot.decode_attention(q.reshape(h, hd), k_cache, v_cache, slot, ctx, scale,
                                         how.window or 0).view(1, h, hd)
        keys, values = k_cache[slot:slot + 1, :, :ctx], v_cache[slot:slot + 1, :, :ctx]  # [1, KVH, C, hd] views
        queries = q.view(1, kvh, h // kvh, hd)  # GQA as query length: [1, KVH, g, hd]
        return sdpa(queries, keys, values, how, self.sliding_mask if how.window else None).view(1, h, hd)


@dataclass
class DecodeWindow:
    """Batched decode attention that reads the KV cache in place. The batch's slots lie in [lo, lo + span)
    (KVCache hands out the lowest free slot, so live sequences stay packed); attention runs over that slice of the
    cache as a view -- slots in it that are not in the batch compute a throw-away row -- instead of gathering
    every sequence's K/V. Built once per step, used by every layer. GQA as query length: the g = H / KVH query
    heads sharing a kv head become g queries of that head, so no K/V is repeated."""

    lo: int
    span: int
    rows: torch.Tensor | None  # [B] int64: each sequence's row in the window (slot - lo); None: row i is slot lo + i
    mask: torch.Tensor | None  # [span, 1, 1, ctx] additive (0 / -inf, the query dtype); None: every row sees ctx keys
    ctx: int
    group: int
    token_slots: torch.Tensor  # [B] int64: each sequence's slot (where its K/V row is written)
    positions: torch.Tensor  # [B] int64
    sliding_mask: torch.Tensor | None = None  # the same for sliding-window layers; None: as mask (no key out of window)

    traced = False  # an eager step's

    @classmethod
    def over(cls, slots: list[int], positions: torch.Tensor, c: ModelConfig, dtype: torch.dtype) -> DecodeWindow:
        """The window of one decode token per slot: slots [B], positions [B] int64."""
        token_slots = torch.tensor(slots, device=positions.device)
        lo, hi = min(slots), max(slots)
        span = hi - lo + 1
        ctx = int(positions.max()) + 1
        in_order = slots == list(range(lo, lo + span))
        rows = None if in_order else token_slots - lo
        ragged = not (in_order and bool((positions == ctx - 1).all()))
        sliding = bool(c.sliding_window) and ctx > c.sliding_window  # some key lies outside some row's window
        mask = sliding_mask = None
        if ragged or sliding:
            ends = torch.ones(span, dtype=torch.long, device=positions.device)  # unused rows: key 0 only
            ends[token_slots - lo] = positions + 1
            keys = torch.arange(ctx, device=ends.device)[None, :]
            visible = keys < ends[:, None]  # [span, ctx]

            def additive(visible: torch.Tensor) -> torch.Tensor:  # [span, ctx] bool -> [span, 1, 1, ctx] 0 / -inf
                out = torch.zeros(visible.shape, dtype=dtype, device=ends.device).masked_fill_(~visible, float("-inf"))
                return out[:, None, None, :]

            mask = additive(visible) if ragged else None
            sliding_mask = additive(visible & (keys >= ends[:, None] - c.sliding_window)) if sliding else None
        return cls(lo, span, rows, mask, ctx, c.num_heads // c.num_kv_heads, token_slots, positions, sliding_mask)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, how: Scores = Scores()) -> torch.Tensor:
        """q [B, H, hd] -> [B, H, hd] against k_cache / v_cache [slots, KVH, max_seq, hd]."""
        b, h, hd = q.shape
        window = slice(self.lo, self.lo + self.span)
        keys, values = k_cache[window, :, :self.ctx], v_cache[window, :, :self.ctx]  # [span, KVH, ctx, hd] views
        if self.rows is None:
            queries = q.view(b, h // self.group, self.group, hd)  # [span, KVH, g, hd]
        else:
            queries = q.new_zeros(self.span, h // self.group, self.group, hd)
            queries[self.rows] = q.view(b, h // self.group, self.group, hd)
        mask = self.sliding_mask if how.window and self.sliding_mask is not None else self.mask
        out = sdpa(queries, keys, values, how, mask)  # [span, KVH, g, hd]
        return (out if self.rows is None else out[self.rows]).view(b, h, hd)


SLOT_GAP = 2  # batched decode reads one window per run of the batch's slots with at most this many unused between


@dataclass
class SplitDecode:
    """Batched decode whose slots lie in runs far apart: one DecodeWindow per run. Live sequences take the lowest free
    slots, but once kept prefixes fill the free ones, a new sequence gets the slot a given-up prefix left, anywhere;
    one window from the lowest to that slot would attend with every kept prefix between (a throw-away row each, at
    its full context). Each run also attends only to its own longest context."""

    token_slots: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    parts: list[tuple[torch.Tensor, DecodeWindow]]  # the batch's rows of a run ([b] int64) and the run's window

    traced = False  # an eager step's

    @classmethod
    def of(cls, layout: BatchLayout, c: ModelConfig, dtype: torch.dtype) -> DecodeWindow | SplitDecode:
        """A DecodeWindow where the batch's slots form one run, else a SplitDecode."""
        slots = layout.slots
        order = sorted(range(len(slots)), key=slots.__getitem__)
        runs = [[order[0]]]
        for i in order[1:]:
            if slots[i] - slots[runs[-1][-1]] > SLOT_GAP + 1:
                runs.append([i])
            else:
                runs[-1].append(i)
        if len(runs) == 1:
            return DecodeWindow.over(slots, layout.positions, c, dtype)
        parts = []
        for run in runs:
            rows = torch.tensor(run, device=layout.positions.device)
            parts.append((rows, DecodeWindow.over([slots[i] for i in run], layout.positions[rows], c, dtype)))
        return cls(layout.token_slots, layout.positions, parts)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, how: Scores = Scores()) -> torch.Tensor:
        """q [B, H, hd] -> [B, H, hd]."""
        out = torch.empty_like(q)
        for rows, window in self.parts:
            out[rows] = window.attend(q[rows], k_cache, v_cache, how)
        return out


@dataclass
class KernelDecode(LaidOut):
    """Batched decode with qdot.cpp's decode_attention_batch, where the integer-dot kernels load (an AVX2 CPU) and the
    activations are float32: each sequence reads exactly its own slot's first position + 1 cached positions, in place,
    each key and value row once -- no window of throw-away rows, no mask, no padding to the longest context -- and
    its numbers are those of the compiled one-sequence step's kernel, whatever else is in the batch (a sliding layer
    reads its window's positions). A layer with a soft cap attends as SplitDecode does (`fallback`, built on first
    use)."""

    layout: BatchLayout
    config: ModelConfig
    dtype: torch.dtype

    @staticmethod
    def applies(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> bool:
        """The kernel takes the decode attention of a piece of this model in `dtype` on `device` (softcapped layers
        aside)."""
        return device.type == "cpu" and KernelDecode.why_not(config, dtype) is None

    @staticmethod
    def why_not(config: ModelConfig, dtype: torch.dtype) -> str | None:
        """None where the kernel takes the attention of a piece of this model in `dtype` (softcapped layers aside);
        otherwise why not."""
        if dtype != torch.float32 or config.head_dim % 8:
            return "the decode-attention kernel takes float32 activations and a head size that is a multiple of 8"
        if not qdot.usable():
            return f"the decode-attention kernel does not run here ({qdot.why_not()})"
        return None

    @functools.cached_property
    def contexts(self) -> torch.Tensor:
        return self.layout.positions + 1  # [B] int64: each sequence attends to its positions 0..position

    @functools.cached_property
    def fallback(self) -> DecodeWindow | SplitDecode:
        return SplitDecode.of(self.layout, self.config, self.dtype)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, how: Scores = Scores()) -> torch.Tensor:
        """q [B, H, hd] -> [B, H, hd]."""
        if how.softcap:
            return self.fallback.attend(q, k_cache, v_cache, how)
        return kernel_attention(q, k_cache, v_cache, self.token_slots, self.contexts, how)


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     contexts: torch.Tensor, how: Scores) -> torch.Tensor:
    """q [B, H, hd] float32 -> [B, H, hd]: sequence b against the first contexts[b] cached positions of row slots[b],
    on a sliding layer the last how.window of them (qdot.decode_attention_batch; no soft cap)."""
    scale = how.scale if how.scale is not None else q.shape[-1] ** -0.5
    return qdot.decode_attention_batch(q, k_cache, v_cache, slots, contexts, scale, how.window or 0)


@dataclass
class BatchDecode:
    """The compiled batched decode step's attention (shared.models.compiled_decode): B sequences one token each, on
    qdot.cpp's kernel, as KernelDecode attends eagerly. Tensors only, and none whose values make a shape: B is the
    graph's one dynamic size (every tensor's first), so one graph serves every batch of 2 or more sequences, any
    slots, any contexts. For pieces whose every layer the kernel covers (BatchDecode.covers)."""

    token_slots: torch.Tensor  # [B] int64: each sequence's KV row
    positions: torch.Tensor  # [B] int64
    contexts: torch.Tensor  # [B] int64: positions + 1, the cached positions each attends to

    traced = True  # the compiled step's

    @classmethod
    def at(cls, slots: list[int], positions: torch.Tensor) -> BatchDecode:
        positions = positions.to(torch.long).clone()  # a tensor of the caller's inference mode (dynamo guards on it)
        return cls(torch.tensor(slots, dtype=torch.long), positions, positions + 1)

    @staticmethod
    def covers(c: ModelConfig, dtype: torch.dtype) -> str | None:
        """None when every layer of a piece of this model in `dtype` attends on the kernel; otherwise why not."""
        if why := KernelDecode.why_not(c, dtype):
            return why
        if c.attn_softcap:
            return "layers with an attention soft cap attend with SDPA"
        if c.num_experts:
            return "a mixture-of-experts block runs its experts eagerly"
        return None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, how: Scores = Scores()) -> torch.Tensor:
        """q [B, H, hd] -> [B, H, hd]."""
        return kernel_attention(q, k_cache, v_cache, self.token_slots, self.contexts, how)


def choose_attention(config: ModelConfig, dtype: torch.dtype, batch_invariant: bool,
                     layout: BatchLayout) -> Attention:
    """The eager step's attention for a piece of this model in `dtype`, by the table above."""
    kernel = KernelDecode.applies(config, dtype, layout.positions.device)
    if layout.decode_only and not batch_invariant:
        return KernelDecode(layout, config, dtype) if kernel else SplitDecode.of(layout, config, dtype)
    return ChunkAttention(layout, batch_invariant, kernel=batch_invariant and kernel)
