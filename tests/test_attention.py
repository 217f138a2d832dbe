"""Every attention strategy (shared/models/attention.py) against one float64 reference, over one matrix of steps:
decode batches (packed slots, slots far apart, ragged contexts), prefill chunks, a k-token step beside decodes; plain
layers, sliding-window ones, soft-capped ones, another scale; float32 and bfloat16. A strategy is tried on every
step and layer it serves, so every pair of them agrees within the tolerance of the pair's dtypes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shared.batch.layout import BatchLayout
from shared.batch.steps import Decode, Prefill
from shared.errors import BadBatch
from shared.kernels import qdot
from shared.models.attention import (
    BatchDecode,
    ChunkAttention,
    DecodeWindow,
    KernelDecode,
    OneSequenceDecode,
    Scores,
    SplitDecode,
    choose_attention,
)

H, KVH, HD, SLOTS, MAX_SEQ = 8, 2, 16, 12, 96
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # of the largest |value|

STEPS = {  # (slot, step) per sequence
    "decode, packed slots": [(0, Decode(40)), (1, Decode(7)), (2, Decode(63))],
    "decode, slots far apart": [(0, Decode(20)), (9, Decode(50)), (10, Decode(3))],
    "decode, one sequence": [(5, Decode(70))],
    "prefill chunks": [(3, Prefill(17, 0, 40, False)), (4, Prefill(9, 30, 39, True))],
    "a 4-token step beside decodes": [(6, Decode(33, 4)), (7, Decode(12))],
}
LAYERS = {"plain": Scores(), "sliding window 16": Scores(window=16), "soft cap 30": Scores(softcap=30.0),
          "scale 0.1": Scores(scale=0.1)}


def reference(q, k_cache, v_cache, seqs, how: Scores) -> torch.Tensor:
    """Each query row over the keys it sees, in float64, one row at a time."""
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    scale = how.scale if how.scale is not None else HD ** -0.5
    for slot, step in seqs:
        for t in range(step.num_tokens):
            pos = step.start_position + t
            first = max(0, pos + 1 - how.window) if how.window else 0
            for h in range(H):
                keys = k_cache[slot, h // (H // KVH), first:pos + 1].double()
                s = keys @ q[row, h].double() * scale
                if how.softcap:
                    s = torch.tanh(s / how.softcap) * how.softcap
                out[row, h] = torch.softmax(s, 0) @ v_cache[slot, h // (H // KVH), first:pos + 1].double()
            row += 1
    return out


def strategies(seqs, layout: BatchLayout, how: Scores, dtype: torch.dtype):
    """(name, attention) for every strategy that serves this step and layer in this dtype."""
    config = SimpleNamespace(num_heads=H, num_kv_heads=KVH, sliding_window=how.window)
    yield "ChunkAttention", ChunkAttention(layout, rowwise=False)
    yield "ChunkAttention rowwise (batch-invariant)", ChunkAttention(layout, rowwise=True)
    if qdot.usable() and dtype == torch.float32:  # soft-capped layers: its per-row SDPA
        yield "ChunkAttention rowwise on the kernel", ChunkAttention(layout, rowwise=True, kernel=True)
    if not layout.decode_only:
        return
    yield "SplitDecode / DecodeWindow", SplitDecode.of(layout, config, dtype)
    kernel = qdot.usable() and dtype == torch.float32
    if kernel:
        yield "KernelDecode", KernelDecode(layout, config, dtype)  # a soft cap: its SplitDecode fallback
        if not how.softcap:  # the compiled batch step refuses soft-capped models (BatchDecode.covers)
            yield "BatchDecode (compiled batch)", BatchDecode.at(layout.slots, layout.positions)
    if len(seqs) == 1:
        slot, step = seqs[0]
        yield "OneSequenceDecode (compiled one)", OneSequenceDecode.at(slot, step.start_position, config, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("step", STEPS)
def test_every_strategy_agrees_with_the_reference(step, layer, dtype):
    gen = torch.Generator().manual_seed(hash((step, layer)) % 2**31)
    seqs, how = STEPS[step], LAYERS[layer]
    k_cache = torch.randn(SLOTS, KVH, MAX_SEQ, HD, generator=gen).to(dtype)
    v_cache = torch.randn(SLOTS, KVH, MAX_SEQ, HD, generator=gen).to(dtype)
    layout = BatchLayout.build([s for s, _ in seqs], [st for _, st in seqs], MAX_SEQ)
    q = torch.randn(layout.num_tokens, H, HD, generator=gen).to(dtype)
    want = reference(q, k_cache, v_cache, seqs, how)
    tried = []
    for name, attention in strategies(seqs, layout, how, dtype):
        assert torch.equal(attention.token_slots, layout.token_slots) and torch.equal(attention.positions,
                                                                                        layout.positions), name
        got = attention.attend(q, k_cache, v_cache, how).double()
        err = float((got - want).abs().max())
        assert err <= TOLERANCE[dtype] * float(want.abs().max()), f"{name}: off by {err:.3g} on {step}, {layer}"
        tried.append(name)
    assert len(tried) >= (2 if not layout.decode_only else 3)
    if layout.decode_only and dtype == torch.float32 and qdot.usable():
        assert "KernelDecode" in tried  # where the kernels load, the float32 decode path is in the matrix


def test_a_window_of_slots_is_one_slice_and_far_apart_slots_are_split():
    config = SimpleNamespace(num_heads=H, num_kv_heads=KVH, sliding_window=0)
    packed = BatchLayout.build([0, 1, 3], [Decode(5), Decode(6), Decode(7)], MAX_SEQ)
    apart = BatchLayout.build([0, 9], [Decode(5), Decode(6)], MAX_SEQ)
    assert isinstance(SplitDecode.of(packed, config, torch.float32), DecodeWindow)
    split = SplitDecode.of(apart, config, torch.float32)
    assert isinstance(split, SplitDecode) and len(split.parts) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("invariant", [False, True], ids=["", "batch-invariant"])
def test_the_eager_choice_follows_the_table(dtype, invariant):
    """choose_attention by (step, dtype, mode, this CPU), as attention.py's table says."""
    config = SimpleNamespace(num_heads=H, num_kv_heads=KVH, sliding_window=0, head_dim=HD)
    decodes = BatchLayout.build([0, 1], [Decode(5), Decode(9)], MAX_SEQ)
    chunk = BatchLayout.build([0, 1], [Prefill(4, 0, 4, True), Decode(9)], MAX_SEQ)
    kernel = dtype == torch.float32 and qdot.usable()
    got = choose_attention(config, dtype, invariant, chunk)
    assert isinstance(got, ChunkAttention) and got.rowwise == invariant and got.kernel == (invariant and kernel)
    got = choose_attention(config, dtype, invariant, decodes)
    if invariant:
        assert isinstance(got, ChunkAttention) and got.rowwise and got.kernel == kernel
    elif dtype == torch.float32 and qdot.usable():
        assert isinstance(got, KernelDecode)
    else:
        assert isinstance(got, (DecodeWindow, SplitDecode))


@pytest.mark.skipif(not qdot.usable(), reason="the batch-invariant kernel path needs qdot.cpp (an AVX2 CPU)")
@pytest.mark.parametrize("layer", ["plain", "sliding window 16"])
def test_batch_invariant_rows_on_the_kernel_do_not_depend_on_how_a_prompt_is_cut(layer):
    """The batch-invariant mode's kernel path: a prompt's rows prefilled in one chunk, in two uneven chunks beside
    another sequence's chunk, and token by token as decodes give the same bits, row for row."""
    how, n = LAYERS[layer], 61
    gen = torch.Generator().manual_seed(n)
    k_cache, v_cache = (torch.randn(SLOTS, KVH, MAX_SEQ, HD, generator=gen) for _ in range(2))
    q = torch.randn(n, H, HD, generator=gen)

    def run(seqs, rows):  # the attention of `rows` (q's rows, in layout order) for steps `seqs`
        layout = BatchLayout.build([s for s, _ in seqs], [st for _, st in seqs], MAX_SEQ)
        return ChunkAttention(layout, rowwise=True, kernel=True).attend(rows, k_cache, v_cache, how)

    whole = run([(2, Prefill(n, 0, n, True))], q)
    other = torch.randn(9, H, HD, generator=gen)
    cut = 23
    first = run([(7, Prefill(9, 0, 20, False)), (2, Prefill(cut, 0, n, False))], torch.cat([other, q[:cut]]))[9:]
    rest = run([(2, Prefill(n - cut, cut, n, True)), (5, Decode(40))], torch.cat([q[cut:], other[:1]]))[:n - cut]
    one_by_one = torch.cat([run([(2, Decode(t) if t else Prefill(1, 0, n, False))], q[t:t + 1]) for t in range(n)])
    assert torch.equal(whole, torch.cat([first, rest]))
    assert torch.equal(whole, one_by_one)
    assert not torch.equal(whole[:-1], whole[1:])  # rows differ: the comparison sees the rows' order


def test_positions_lie_as_rows_in_a_micro_batch_of_decodes_only():
    """decodes_only: a decode of several positions laid out as one-token rows (its slot repeated, its positions one
    a row); a micro-batch with a prefill chunk in it is refused that layout."""
    rows = BatchLayout.build([0, 1], [Decode(4, 3), Decode(7)], MAX_SEQ, positions_as_rows=True)
    assert rows.slots == [0, 0, 0, 1] and rows.starts == [4, 5, 6, 7] and rows.lengths == [1] * 4 and rows.decode_only
    assert BatchLayout.build([0, 1], [Decode(4, 3), Decode(7)], MAX_SEQ).lengths == [3, 1]
    with pytest.raises(BadBatch, match="decodes only"):
        BatchLayout.build([0, 1], [Decode(4, 3), Prefill(2, 0, 2, True)], MAX_SEQ, positions_as_rows=True)
