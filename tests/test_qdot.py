"""The integer-dot kernels (shared/kernels/qdot.cpp) against llama.cpp's scheme written out in numpy: activations
quantized per block of 32 to int8 with fp16 scales, exact integer dot products, float scaling. Built and run here
on any CPU with AVX2, whether or not this CPU's stages pick them (qdot.usable())."""

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from shared.errors import CapabilityMissing
from shared.files.gguf_loader import RawTensor
from shared.kernels import qdot
from shared.models.linear import QdotLinear, qdot_kind, stored_kernel
from shared.models.quant import dequantize, unpack_levels

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the types gguf's quantizer writes (Q4_K: _q4_k_raw)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    why = qdot.load()
    if why is not None:
        pytest.skip(f"the integer-dot kernels cannot run on this machine: {why}")


def _raw(qtype: str, rows: int, cols: int, seed: int = 0) -> RawTensor:
    rng = np.random.default_rng(seed)
    data = quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), GGMLQuantizationType[qtype])
    return RawTensor("w", qtype, (rows, cols), torch.from_numpy(np.ascontiguousarray(data)).view(rows, -1))


def _q8_activations(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_1: x [M, K] -> levels [M, K/32, 32], each block's d and d x sum(levels) (fp16); with
    block=16 (the q6_16 kernel's), the same per 16: [M, K/16, 16]."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // block, block)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qx = np.rint(xb * inv[..., None]).astype(np.int64)  # round half to even, as _mm256_round_ps
    dx = d.astype(np.float16).astype(np.float64)
    sx = (d * qx.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float64)
    return qx, dx, sx


def _llama_cpp_product(x: np.ndarray, raw: RawTensor) -> np.ndarray:
    """ggml's quantize_row_q8_1 and vec_dot_q4_{0,1}_q8_1 / q5_0_q8_0 / q5_1_q8_1 / q8_0_q8_0, in numpy, summed in
    float64."""
    levels, scale, low = (t.numpy() for t in unpack_levels(raw))
    if raw.ggml_type in ("Q8_0", "Q5_0"):  # signed levels (Q5_0's less 16), no offset term
        qx, dx, _ = _q8_activations(x)
        lv = levels.reshape(levels.shape[0], -1, 32).astype(np.int64) - (128 if raw.ggml_type == "Q8_0" else 16)
        dots = np.einsum("nbj,mbj->mnb", lv, qx)
        return np.einsum("nb,mb,mnb->mn", scale.astype(np.float64), dx, dots)
    return _llama_cpp_product_of(x, levels, scale, low)


def _llama_cpp_product_of(x: np.ndarray, levels: np.ndarray, scale: np.ndarray, low: np.ndarray) -> np.ndarray:
    """vec_dot_q4_1_q8_1's sum for levels [N, K] 0..15 with a scale and a low per group of 32 ([N, K/32])."""
    qx, dx, sx = _q8_activations(x)
    lv = levels.reshape(levels.shape[0], -1, 32).astype(np.int64)
    dots = np.einsum("nbj,mbj->mnb", lv, qx)
    return (np.einsum("nb,mb,mnb->mn", scale.astype(np.float64), dx, dots)
            + np.einsum("nb,mb->mn", low.astype(np.float64), sx))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,cols", [(43, 64), (96, 576), (5, 96)])
def test_the_product_is_llama_cpps_to_float32_rounding(qtype, rows, cols):
    """Per output, the kernel's fp32 sum of per-block terms equals the float64 sum of the same terms: a wrong nibble
    order, interleaving, sign trick, offset or activation rounding would be off by far more than fp32's rounding.
    43 and 5 rows: the kernel takes rows 8 at a time, the last group padded (torch's int4 kernel needs 16 | N)."""
    raw = _raw(qtype, rows, cols, seed=rows)
    w = QdotLinear(raw)
    for m in (1, 3, 4, 9):
        x = torch.randn(m, cols)
        x[0, :32] = 0.0  # an all-zero block: its scale is 0, not a division by zero
        expected = _llama_cpp_product(x.numpy(), raw)
        got = w(x).double().numpy()
        assert got.shape == (m, rows)
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6 * np.abs(expected).max())


@pytest.mark.parametrize("qtype", TYPES + ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"))
def test_a_rows_result_depends_neither_on_its_batch_nor_on_the_thread_count(qtype):
    """The batch-invariant mode's requirement: row i of an M-row call equals the row alone, bit for bit, for every M
    (the kernel tiles rows by 8, 4 and 1 to 3, and takes 2 groups of 8 weight rows at once in 512-bit registers
    where it can, group by group where it cannot: 7 groups here, the last alone) and whether one thread or two
    split the weight's rows."""
    makers = {"Q4_K": _q4_k_raw, "Q5_K": _q5_k_raw, "Q6_K": _q6_k_raw, "Q2_K": functools.partial(_k_low_raw, "Q2_K"),
              "Q3_K": functools.partial(_k_low_raw, "Q3_K")}
    raw = makers[qtype](56, 256, seed=3) if "_K" in qtype else _raw(qtype, 56, 256, seed=3)
    w = QdotLinear(raw, tile_rows=0)  # the batch-invariant mode's: no AMX path (its own test below)
    x = torch.randn(21, 256)
    alone = torch.cat([w(x[i:i + 1]) for i in range(21)])
    for m in range(1, 22):
        assert torch.equal(w(x[:m]), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)


def _q4_k_raw(rows: int, cols: int, seed: int = 0) -> RawTensor:
    """A Q4_K matrix of random superblocks (gguf's quantizer does not write the type): any 6-bit scales and mins and
    nibbles are valid, with d and dmin a weight's usual sizes."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, cols // 256, 144), dtype=torch.uint8, generator=g)
    b[..., 0:2] = (torch.rand(rows, cols // 256, 1, generator=g) * 2e-3 + 1e-4).half().view(torch.uint8)
    b[..., 2:4] = (torch.rand(rows, cols // 256, 1, generator=g) * 2e-3).half().view(torch.uint8)
    return RawTensor("w", "Q4_K", (rows, cols), b.view(rows, -1))


def test_q5_0_and_q5_1_keep_their_size_and_q4_k_runs_as_q4_1_blocks():
    """Q5_0 {d, qh, nibbles} and Q5_1 {d, m, qh, nibbles} keep their own bytes, the fifth bits after the nibbles (and
    spread for the kernel, qdot._fifth_bit_masks): 0.69 and 0.75 bytes a weight, the same numbers, so the product
    is llama.cpp's (the test above runs it, random fifth bits included). Q4_K's superblocks become Q4_1 blocks, one per group of 32, {d*sc, -dmin*mn} rounded to fp16:
    the product is llama.cpp's sum of per-block terms with those scales, and within their rounding of the exact
    weights' product."""
    raw = _raw("Q5_0", 16, 64, seed=9)
    w = QdotLinear(raw)
    assert w.kind == qdot_kind("Q5_0") and w.nbytes == 16 * 2 * 22
    assert QdotLinear(_raw("Q5_1", 16, 64, seed=9)).nbytes == 16 * 2 * 24
    raw = _q4_k_raw(24, 512, seed=4)
    w = QdotLinear(raw)
    assert w.kind == qdot_kind("Q4_K") and w.nbytes == 24 * 16 * 20
    levels, scale, low = unpack_levels(raw)
    x = torch.randn(3, 512)
    x[0, :32] = 0.0
    got = w(x).double().numpy()
    want = _llama_cpp_product_of(x.numpy(), levels.numpy(), scale.half().float().numpy(), low.half().float().numpy())
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    exact = (x.double() @ dequantize(raw).double().T).numpy()
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())
    assert np.abs(got - exact).max() > 0  # (the activations' 8-bit rounding, at least)


def _q5_k_raw(rows: int, cols: int, seed: int = 0) -> RawTensor:
    """A Q5_K matrix of random superblocks (176 bytes: d, dmin, 12 of 6-bit scales and mins, 32 of fifth bits, 128
    of nibbles): any bits are valid, with d and dmin a weight's usual sizes."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, cols // 256, 176), dtype=torch.uint8, generator=g)
    b[..., 0:2] = (torch.rand(rows, cols // 256, 1, generator=g) * 1e-3 + 1e-4).half().view(torch.uint8)
    b[..., 2:4] = (torch.rand(rows, cols // 256, 1, generator=g) * 1e-3).half().view(torch.uint8)
    return RawTensor("w", "Q5_K", (rows, cols), b.view(rows, -1))


def test_q5_k_runs_as_q5_1_blocks():
    """Q5_K's superblocks become q5_1 blocks, one per group of 32, {d*sc, -dmin*mn} rounded to fp16, its 5-bit
    levels (fifth bits included) untouched: 0.75 bytes a weight (the file's 0.69), and the product is llama.cpp's
    sum of per-block terms with those scales; a lost fifth bit or a swapped half would be far off."""
    raw = _q5_k_raw(43, 512, seed=5)  # 43 rows: the last group of 8 padded
    w = QdotLinear(raw)
    assert w.kind == qdot_kind("Q5_K") and w.nbytes == 48 * 16 * 24
    levels, scale, low = unpack_levels(raw)
    assert int(levels.max()) == 31  # the fifth bits are there to lose
    for m in (1, 5, 12):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        x[0, :32] = 0.0
        got = w(x).double().numpy()
        want = _llama_cpp_product_of(x.numpy(), levels.numpy(), scale.half().float().numpy(),
                                     low.half().float().numpy())
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
        exact = (x.double() @ dequantize(raw).double().T).numpy()
        np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


def _q6_k_raw(rows: int, cols: int, seed: int = 0) -> RawTensor:
    """A Q6_K matrix of random superblocks (gguf's quantizer does not write the type): any bits and int8 scales are
    valid, with d a weight's usual size."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, cols // 256, 210), dtype=torch.uint8, generator=g)
    b[..., 208:210] = (torch.rand(rows, cols // 256, 1, generator=g) * 2e-3 + 1e-4).half().view(torch.uint8)
    return RawTensor("w", "Q6_K", (rows, cols), b.view(rows, -1))


def test_q6_k_runs_as_q6_16_blocks_with_the_files_numbers():
    """Q6_K's levels (-32..31) and its scales per 16 (d * sc, exact in float32) are the file's numbers: they
    reproduce gguf's dequantization bit for bit. The kernel's q6_16 blocks carry both halves' scales, and it rounds
    the activations to 8 bits per 16 as well (llama.cpp per 256 for this type; per 32, Gemma 3's perplexity was 2.5 %
    higher), so the product is the sum of per-16 integer dots, each scaled by its half's weight and activation
    scales: swapping the halves or the bit planes, or quantizing the activations per 32, would be far off."""
    from shared.models.quant import q6_k_levels

    raw = _q6_k_raw(43, 512, seed=6)  # 43 rows: the last group of 8 padded
    levels, scale = q6_k_levels(raw)
    assert levels.dtype == torch.int8 and int(levels.min()) >= -32 and int(levels.max()) <= 31
    weights = (levels.float().view(43, -1, 16) * scale[..., None]).view(43, 512)
    np.testing.assert_array_equal(weights.numpy(), dequantize(raw).numpy())
    w = QdotLinear(raw)
    assert w.kind == qdot_kind("Q6_K") and w.nbytes == 48 * 16 * 28  # 7 bits a weight
    for m in (1, 4, 7):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        x[0, :32] = 0.0
        qx, dx, _ = _q8_activations(x.numpy(), block=16)
        halves = np.einsum("nbj,mbj->mnb", levels.numpy().astype(np.int64).reshape(43, -1, 16), qx)
        want = np.einsum("nb,mb,mnb->mn", scale.double().numpy(), dx, halves)
        got = w(x).double().numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
        exact = (x.double() @ weights.double().T).numpy()
        np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q6_K"])
def test_on_amx_a_prefill_sized_call_is_the_bf16_product_of_the_blocks_weights(qtype):
    """Where the AMX tiles run (qdot.amx_rows(): on this CPU, granted the tile state), a q4_1 / q8_0 / q6_16 call of
    at least tile_rows rows multiplies x rounded to bf16 by the blocks' weights rounded to bf16, products summed in
    float32: within float32 rounding of that product taken in float64. A wrong pair layout, n-tile, column offset,
    K slice or padded row would be off by the size of the weights. 43 weight rows: the last of two 32-row buffers
    holds 11 (one row padding); K = 2048: the 600-row call takes K in three slices (x's bf16 slice sized for L2), a
    call of tile_rows rows in one. A row's result depends on nothing but that row from tile_rows rows on (bit for bit, any M,
    one thread or two), and below tile_rows, or with tile_rows=0, the integer-dot path runs: llama.cpp's scheme."""
    if (why := qdot.amx_why_not()) is not None:
        pytest.skip(f"the AMX path does not run on this machine: {why}")
    raw = _q6_k_raw(43, 2048, seed=11) if qtype == "Q6_K" else _raw(qtype, 43, 2048, seed=11)
    w = QdotLinear(raw)
    rows = qdot.amx_rows()
    assert w.tile_rows == rows and "amx-bf16" in w.kind
    weights = dequantize(raw).bfloat16().double()
    x = torch.randn(600, 2048, generator=torch.Generator().manual_seed(5))
    x[3, :64] = 0.0
    full = w(x)
    want = x.bfloat16().double() @ weights.T
    np.testing.assert_allclose(full.double().numpy(), want.numpy(), rtol=0, atol=1e-5 * want.abs().max().item())
    exact = x.double() @ dequantize(raw).double().T  # and bf16 is no further from the exact product than the 8-bit
    err = (full.double() - exact).abs().max() / exact.abs().max()  # scheme (llama.cpp's) is
    vnni = (qdot.mm(w.op, x, w.blocks, w.out_features, 0).double() - exact).abs().max() / exact.abs().max()
    assert err < vnni, (err, vnni)
    for m in (rows, rows + 1, rows + 15, rows + 16, 100):  # 16-row tiles in pairs, the last pair half padding or not
        assert torch.equal(w(x[:m]), full[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(w(x[:100]), full[:100])
    finally:
        torch.set_num_threads(threads)
    below = x[:rows - 1]
    assert torch.equal(w(below), QdotLinear(raw, tile_rows=0)(below))
    invariant = stored_kernel(raw, fixed_rows=8)  # the batch-invariant mode never takes the tiles
    assert invariant.tile_rows == 0 and "amx" not in invariant.kind


def test_q4_0_runs_as_q4_1_blocks_with_its_offset_spelled_out():
    """Q4_0 {d, 16 bytes} becomes {d, -8d, 16 bytes}: the same size as Q4_1's blocks, the same numbers."""
    raw = _raw("Q4_0", 32, 64, seed=7)
    w = QdotLinear(raw)
    assert w.blocks.shape == (32 // 8, 2 * 8 * 20) and w.nbytes == 32 * 2 * 20
    blocks = w.blocks.view(32 // 8, 2, 8 * 20)  # [group of 8 rows, block, {8 d, 8 m, levels}]
    d = blocks[..., 0:16].contiguous().view(torch.float16).float()
    low = blocks[..., 16:32].contiguous().view(torch.float16).float()
    _, scale, _ = unpack_levels(raw)  # [rows, blocks]
    torch.testing.assert_close(d, scale.view(4, 8, 2).transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(low, -8.0 * d, rtol=0, atol=0)


def test_bad_inputs_are_refused_with_what_was_wrong():
    w = QdotLinear(_raw("Q4_1", 32, 64))
    with pytest.raises(RuntimeError, match="K = 96"):
        torch.ops.stagemesh_qdot.q4_1(torch.randn(2, 96), w.blocks, 32)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.stagemesh_qdot.q4_1(torch.randn(2, 64).double(), w.blocks, 32)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.stagemesh_qdot.q8_0(torch.randn(2, 64), w.blocks.float(), 32)
    with pytest.raises(RuntimeError, match="N = 40 rows do not fill 4 groups"):
        torch.ops.stagemesh_qdot.q4_1(torch.randn(2, 64), w.blocks, 40)


@pytest.mark.parametrize("rows,kv_heads,max_seq,head_dim,group", [(5, 3, 600, 64, 3), (3, 1, 300, 256, 4),
                                                                    (4, 8, 300, 128, 1), (2, 2, 64, 16, 2),
                                                                    (2, 2, 300, 32, 7)])
def test_decode_attention_is_torchs_attention_over_the_slots_first_positions(rows, kv_heads, max_seq, head_dim, group):
    """qdot.decode_attention against torch's scaled_dot_product_attention on the slot's slice of the cache: every
    slot, contexts on both sides of the kernel's 256-position chunks, grouped queries, head sizes 16-256. It reads
    only the slot's first ctx positions (the rest of the cache is NaN here)."""
    g = torch.Generator().manual_seed(rows * 100 + max_seq)
    k = torch.randn(rows, kv_heads, max_seq, head_dim, generator=g)
    v = torch.randn(rows, kv_heads, max_seq, head_dim, generator=g)
    heads = kv_heads * group
    for ctx in sorted({1, 7, 255, 256, 257, 513, max_seq} & set(range(1, max_seq + 1))):
        for slot in range(rows):
            keys, values = k.clone(), v.clone()
            keys[:, :, ctx:], values[:, :, ctx:] = float("nan"), float("nan")
            keys[torch.arange(rows) != slot], values[torch.arange(rows) != slot] = float("nan"), float("nan")
            q = torch.randn(heads, head_dim, generator=g)
            scale = head_dim ** -0.5 if slot % 2 else 0.3
            want = torch.nn.functional.scaled_dot_product_attention(
                q.view(1, kv_heads, group, head_dim), k[slot:slot + 1, :, :ctx], v[slot:slot + 1, :, :ctx], scale=scale)
            got = qdot.decode_attention(q, keys, values, slot, ctx, scale)
            torch.testing.assert_close(got, want.view(heads, head_dim), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="slot"):
        qdot.decode_attention(q, k, v, rows, 1, 1.0)
    with pytest.raises(RuntimeError, match="context"):
        qdot.decode_attention(q, k, v, 0, max_seq + 1, 1.0)


@pytest.mark.parametrize("kv_heads,head_dim,group", [(3, 64, 3), (1, 256, 4), (2, 32, 7)])
def test_batched_decode_attention_gives_each_sequence_its_own_attention(kv_heads, head_dim, group):
    """qdot.decode_attention_batch: sequences in scattered slots, contexts from 1 to past two 256-position chunks.
    Each row is decode_attention's for that sequence alone, bit for bit (what else is in the batch changes nothing),
    and torch's attention over the slot's slice; no sequence reads a position it does not attend to, nor a slot
    outside the batch (NaN there)."""
    rows, max_seq, heads = 12, 600, kv_heads * group
    g = torch.Generator().manual_seed(head_dim + group)
    k = torch.randn(rows, kv_heads, max_seq, head_dim, generator=g)
    v = torch.randn(rows, kv_heads, max_seq, head_dim, generator=g)
    slots = torch.tensor([9, 0, 4, 11, 5, 2, 7])
    ctxs = torch.tensor([1, 600, 256, 257, 7, 513, 130])
    keys, values = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for slot, ctx in zip(slots.tolist(), ctxs.tolist()):
        keys[slot, :, :ctx], values[slot, :, :ctx] = k[slot, :, :ctx], v[slot, :, :ctx]
    q = torch.randn(len(slots), heads, head_dim, generator=g)
    got = qdot.decode_attention_batch(q, keys, values, slots, ctxs, 0.2)
    for b, (slot, ctx) in enumerate(zip(slots.tolist(), ctxs.tolist())):
        assert torch.equal(got[b], qdot.decode_attention(q[b], keys, values, slot, ctx, 0.2))
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b].view(1, kv_heads, group, head_dim), k[slot:slot + 1, :, :ctx], v[slot:slot + 1, :, :ctx], scale=0.2)
        torch.testing.assert_close(got[b], want.view(heads, head_dim), rtol=1e-5, atol=1e-5)
    assert torch.equal(qdot.decode_attention_batch(q[2:5], keys, values, slots[2:5], ctxs[2:5], 0.2), got[2:5])
    with pytest.raises(RuntimeError, match="one slot and one context per sequence"):
        qdot.decode_attention_batch(q, keys, values, slots[:3], ctxs[:3], 0.2)
    with pytest.raises(RuntimeError, match="slot 12 is not a row"):
        qdot.decode_attention_batch(q[:1], keys, values, torch.tensor([12]), torch.tensor([1]), 0.2)
    with pytest.raises(RuntimeError, match="context 0 is not within"):
        qdot.decode_attention_batch(q[:1], keys, values, torch.tensor([0]), torch.tensor([0]), 0.2)
    with pytest.raises(RuntimeError, match="int64"):
        qdot.decode_attention_batch(q[:1], keys, values, torch.tensor([0], dtype=torch.int32), torch.tensor([1]), 0.2)


@pytest.mark.parametrize("window", [1, 8, 256, 300])
def test_a_sliding_layer_reads_only_its_window(window):
    """window > 0 (a sliding layer's): sequence b attends to its last `window` positions, ctx - window .. ctx - 1 (all
    of them when ctx is shorter), and reads nothing before them (NaN there). One sequence alone and in a batch give the
    same numbers, bit for bit, and torch's attention over the window's slice."""
    rows, kv_heads, group, head_dim, max_seq = 6, 1, 4, 256, 600
    g = torch.Generator().manual_seed(window)
    k = torch.randn(rows, kv_heads, max_seq, head_dim, generator=g)
    v = torch.randn(rows, kv_heads, max_seq, head_dim, generator=g)
    slots, ctxs = torch.tensor([3, 0, 5, 1, 2]), torch.tensor([1, 9, 257, 600, 513])
    starts = (ctxs - window).clamp(min=0)
    keys, values = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for slot, start, ctx in zip(slots.tolist(), starts.tolist(), ctxs.tolist()):
        keys[slot, :, start:ctx], values[slot, :, start:ctx] = k[slot, :, start:ctx], v[slot, :, start:ctx]
    q = torch.randn(len(slots), kv_heads * group, head_dim, generator=g)
    got = qdot.decode_attention_batch(q, keys, values, slots, ctxs, 0.1, window)
    for b, (slot, start, ctx) in enumerate(zip(slots.tolist(), starts.tolist(), ctxs.tolist())):
        assert torch.equal(got[b], qdot.decode_attention(q[b], keys, values, slot, ctx, 0.1, window))
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b].view(1, kv_heads, group, head_dim), k[slot:slot + 1, :, start:ctx], v[slot:slot + 1, :, start:ctx],
            scale=0.1)
        torch.testing.assert_close(got[b], want.view(-1, head_dim), rtol=1e-5, atol=1e-5)
    assert not torch.isnan(got).any()
    with pytest.raises(RuntimeError, match="window -1 must be 0"):
        qdot.decode_attention_batch(q, keys, values, slots, ctxs, 0.1, -1)


def test_where_the_kernels_are_usable_the_stored_kernel_of_each_type_is_one(monkeypatch):
    """stored_kernel picks them for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q5_K exactly where qdot.usable() says so; STAGEMESH_QDOT=off turns
    them off (a new process: load() and usable() are decided once)."""
    for qtype in TYPES:
        assert isinstance(stored_kernel(_raw(qtype, 32, 64)), QdotLinear) == qdot.usable()
    q5_k = torch.randint(0, 256, (32, 176), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    q5_k[:, 0:4] = torch.full((32, 2), 1e-3).half().view(torch.uint8)
    q5_k_raw = RawTensor("w", "Q5_K", (32, 256), q5_k)
    assert isinstance(stored_kernel(q5_k_raw), QdotLinear) == qdot.usable()  # as q5_1 blocks
    for qtype in ("Q2_K", "Q3_K"):  # on their own superblocks
        assert isinstance(stored_kernel(_k_low_raw(qtype, 32, 256)), QdotLinear) == qdot.usable()
    monkeypatch.setenv(qdot.ENV, "off")
    qdot.load.cache_clear()
    try:
        assert qdot.load() == f"turned off ({qdot.ENV}=off)"
        with pytest.raises(CapabilityMissing, match="turned off"):
            QdotLinear(_raw("Q4_1", 32, 64))
    finally:
        monkeypatch.delenv(qdot.ENV)
        qdot.load.cache_clear()
        assert qdot.load() is None


def test_the_library_is_built_where_the_home_cache_cannot_hold_it(monkeypatch, tmp_path):
    """A container with a read-only root filesystem: the home cache cannot be made, the temporary directory can."""
    home, temp = tmp_path / "home", tmp_path / "tmp"
    (home / ".cache" / "stagemesh").mkdir(parents=True)
    (home / ".cache" / "stagemesh" / "kernels").write_text("not a directory")
    temp.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(qdot.tempfile, "gettempdir", lambda: str(temp))
    path = qdot._library_path()
    assert path.startswith(str(temp / "stagemesh-kernels")) and path.endswith(".so")


def test_temper_is_each_rows_exponential_whatever_the_batch_and_the_threads():
    """qdot.temper (sampling's tempered probabilities): exp((row - max) x 1/T) within an ulp of torch's exp, row by
    row; a banned token (-inf) is exactly 0; a vocabulary that is not a multiple of 8 ends in a scalar tail; and a
    row's numbers are the same alone, in any batch, on 1 or 2 threads (a seeded draw must not depend on its company)."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(7, 1003, generator=g) * 4
    logits[2, [0, 500, 1002]] = float("-inf")
    inv_t = torch.tensor([1 / 0.7, 1.0, 2.5, 1e4, 0.05, 1.0, 3.0])
    got = qdot.temper(logits, inv_t)
    want = torch.stack([(row - row.max()).mul_(float(t)).exp_() for row, t in zip(logits, inv_t)])
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-30)
    assert got[2, [0, 500, 1002]].tolist() == [0.0, 0.0, 0.0] and bool((got.amax(1) == 1.0).all())
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for lo, hi in ((0, 7), (2, 3), (1, 6), (6, 7)):
                assert torch.equal(qdot.temper(logits[lo:hi], inv_t[lo:hi]), got[lo:hi]), (n, lo, hi)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="one float32 inverse temperature per row"):
        qdot.temper(logits, inv_t[:3])


def test_rms_norm_is_torchs_within_rounding_and_each_rows_own():
    """qdot.rms_norm (the eager step's norm): torch's rms_norm within float32 rounding, for widths that are and are
    not a multiple of 8, over any leading dims; a row's numbers the same alone as in any batch, on 1 or 2 threads."""
    g = torch.Generator().manual_seed(5)
    for shape, eps in (((40, 576), 1e-5), ((3, 9, 64), 1e-6), ((2, 13), 1e-6)):
        x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
        got = qdot.rms_norm(x, w, eps)
        torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, eps), rtol=2e-6, atol=2e-6)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for lo, hi in ((0, 40), (7, 8), (3, 35)):
                assert torch.equal(qdot.rms_norm(x := torch.randn(40, 576, generator=torch.Generator().manual_seed(6)),
                                                 w := torch.ones(576), 1e-5)[lo:hi], qdot.rms_norm(x[lo:hi], w, 1e-5))
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32"):
        qdot.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)


def test_write_kv_writes_what_indexed_assignment_writes_and_refuses_rows_outside_the_cache():
    g = torch.Generator().manual_seed(8)
    k_cache, v_cache = torch.randn(4, 3, 20, 16, generator=g), torch.randn(4, 3, 20, 16, generator=g)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots, positions = torch.tensor([1, 3, 1, 0]), torch.tensor([0, 5, 19, 7])
    k, v = torch.randn(4, 3, 16, generator=g), torch.randn(4, 3, 16, generator=g)
    qdot.write_kv(k_cache, v_cache, slots, positions, k, v)
    want_k[slots, :, positions], want_v[slots, :, positions] = k, v
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match=r"row 0 \(slot 4, position 0\) is outside"):
        qdot.write_kv(k_cache, v_cache, torch.tensor([4]), torch.tensor([0]), k[:1], v[:1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_half_precision_cache_is_read_widened_and_written_rounded(dtype):
    """--kv-dtype float16 / bfloat16: the decode-attention kernels read such a cache in place, each value widened to
    float32 exactly, so their output is their output over the widened cache (bit for bit: the same sums in the same
    order); write_kv stores float32 keys and values rounded as torch's .to(dtype) rounds them."""
    g = torch.Generator().manual_seed(11)
    rows, kv_heads, max_seq, head_dim, group = 5, 2, 600, 64, 3
    k = torch.randn(rows, kv_heads, max_seq, head_dim, generator=g).to(dtype)
    v = torch.randn(rows, kv_heads, max_seq, head_dim, generator=g).to(dtype)
    slots, ctxs = torch.tensor([4, 0, 2]), torch.tensor([600, 1, 257])
    q = torch.randn(3, kv_heads * group, head_dim, generator=g)
    got = qdot.decode_attention_batch(q, k, v, slots, ctxs, 0.125)
    assert torch.equal(got, qdot.decode_attention_batch(q, k.float(), v.float(), slots, ctxs, 0.125))
    for b in range(3):
        assert torch.equal(got[b], qdot.decode_attention(q[b], k, v, int(slots[b]), int(ctxs[b]), 0.125))
    with pytest.raises(RuntimeError, match="float32 queries, a float32, float16 or bfloat16 cache"):
        qdot.decode_attention_batch(q, k, v.float(), slots, ctxs, 0.125)
    k_cache, v_cache = torch.zeros(4, 3, 20, 16, dtype=dtype), torch.zeros(4, 3, 20, 16, dtype=dtype)
    slots, positions = torch.tensor([1, 3, 1]), torch.tensor([0, 5, 19])
    new_k, new_v = torch.randn(3, 3, 16, generator=g), torch.randn(3, 3, 16, generator=g)
    qdot.write_kv(k_cache, v_cache, slots, positions, new_k, new_v)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[slots, :, positions], want_v[slots, :, positions] = new_k.to(dtype), new_v.to(dtype)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v) and k_cache.abs().sum() > 0


def _k_low_raw(qtype: str, rows: int, cols: int, seed: int = 0) -> RawTensor:
    """A Q2_K (84 bytes: 16 scale bytes, 64 of 2-bit levels, fp16 d, dmin) or Q3_K (110: 32 of third bits, 64 of 2-bit
    levels, 12 of 6-bit scales, fp16 d) matrix of random superblocks: any bits are valid, d and dmin a weight's sizes."""
    size, d_at = (84, 80) if qtype == "Q2_K" else (110, 108)
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, cols // 256, size), dtype=torch.uint8, generator=g)
    for at in (d_at, 82) if qtype == "Q2_K" else (d_at,):
        b[..., at:at + 2] = (torch.rand(rows, cols // 256, 1, generator=g) * 2e-3 + 1e-4).half().view(torch.uint8)
    return RawTensor("w", qtype, (rows, cols), b.view(rows, -1))


def _q8_k_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_K_ref: x [M, K] -> levels [M, K/256, 256], d [M, K/256] (float32, 1 / iscale), with
    iscale = -127 / (the value of largest magnitude, the first such), levels min(127, round-half-even(iscale x))."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 256, 256)
    first = np.abs(xb).argmax(-1)
    peak = np.take_along_axis(xb, first[..., None], -1)[..., 0]
    iscale = np.where(peak != 0, np.float32(-127) / np.where(peak != 0, peak, 1), 0).astype(np.float32)
    qx = np.minimum(127, np.rint(xb * iscale[..., None])).astype(np.int64)
    d = np.where(peak != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return qx, d.astype(np.float64)


def _llama_cpp_k_low_product(x: np.ndarray, raw: RawTensor) -> np.ndarray:
    """ggml's vec_dot_q2_K_q8_K / q3_K_q8_K in numpy: per superblock, the exact integer sum over its 16 sub-blocks of
    scale x dot (and Q2_K's sum of min x the activations' sum), times d_w d_x (and dmin_w d_x), summed in float64."""
    from shared.models.quant import k_low_levels

    levels, scales, d, dmin = k_low_levels(raw)
    n, k = raw.shape
    qx, dx = _q8_k_activations(x)
    lv = levels.numpy().astype(np.int64).reshape(n, k // 256, 16, 16) - (4 if raw.ggml_type == "Q3_K" else 0)
    sub = np.einsum("nbjl,mbjl->mnbj", lv, qx.reshape(len(x), k // 256, 16, 16))
    sc = scales.numpy().astype(np.int64).reshape(n, k // 256, 16)
    if raw.ggml_type == "Q3_K":
        return np.einsum("nb,mb,mnb->mn", d.double().numpy(), dx, np.einsum("nbj,mnbj->mnb", sc, sub))
    bsums = qx.reshape(len(x), k // 256, 16, 16).sum(-1)
    isum = np.einsum("nbj,mnbj->mnb", sc & 0x0F, sub)
    msum = np.einsum("nbj,mbj->mnb", sc >> 4, bsums)
    return (np.einsum("nb,mb,mnb->mn", d.double().numpy(), dx, isum)
            - np.einsum("nb,mb,mnb->mn", dmin.double().numpy(), dx, msum))


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
def test_q2_k_and_q3_k_run_on_their_own_superblocks_as_llama_cpp_multiplies_them(qtype):
    """Q2_K and Q3_K keep their superblocks of 256 (84 and 114 bytes: Q3_K's 6-bit scales as int8, 4 more than its
    110), their levels regrouped: the unpacked numbers are gguf's dequantization bit for bit, and the product is
    llama.cpp's scheme (activations as q8_K: one float scale per 256, exact integer sums per superblock) to fp32
    rounding, for 1 to 12 rows (the kernel's tiles of 4, 3, 2, 1) and 43 weight rows (the last group of 8 padded). A
    swapped sub-block, scale nibble, third bit or activation scale would be far off."""
    from shared.models.quant import k_low_levels

    raw = _k_low_raw(qtype, 43, 768, seed=8)
    levels, scales, d, dmin = k_low_levels(raw)
    per16 = d.repeat_interleave(16, dim=1) * (scales & 0x0F if qtype == "Q2_K" else scales).float()
    weights = per16.repeat_interleave(16, dim=1) * (levels.float() - (4 if qtype == "Q3_K" else 0))
    if qtype == "Q2_K":
        weights -= (dmin.repeat_interleave(16, dim=1) * (scales >> 4).float()).repeat_interleave(16, dim=1)
    np.testing.assert_allclose(weights.numpy(), dequantize(raw).numpy(), rtol=1e-6, atol=0)
    assert int(levels.max()) == (3 if qtype == "Q2_K" else 7)
    w = QdotLinear(raw)
    assert w.kind == qdot_kind(qtype) and w.nbytes == 48 * 3 * (84 if qtype == "Q2_K" else 114)
    for m in (1, 2, 5, 12):
        x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
        x[0, :256] = 0.0  # an all-zero superblock: its scale is 0, not a division by zero
        got = w(x).double().numpy()
        want = _llama_cpp_k_low_product(x.numpy(), raw)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
        exact = (x.double() @ dequantize(raw).double().T).numpy()
        np.testing.assert_allclose(got, exact, rtol=0, atol=3e-2 * np.abs(exact).max())


@pytest.mark.reference
@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
def test_q2_k_and_q3_k_products_are_llama_cpps_on_blocks_its_quantizer_wrote(qtype):
    """Blocks written by llama.cpp's quantizer (quantize_q2_K / quantize_q3_K) from a weight-like matrix, multiplied
    by llama.cpp's own dot (quantize_row_q8_K, then ggml_vec_dot_q*_K_q8_K, this CPU's SIMD build) row by row: the
    kernel's product is the same to fp32 rounding, and both are the same distance from the exact product of the
    file's numbers (the activations' 8-bit rounding)."""
    import ctypes

    from services.testing.tiny_gguf import ggml_libraries, ggml_quantize_rows

    _, cpu = ggml_libraries()
    ptr = ctypes.c_void_p
    cpu.quantize_row_q8_K.argtypes = [ptr, ptr, ctypes.c_int64]
    vec_dot = getattr(cpu, f"ggml_vec_dot_{qtype[:2].lower()}_K_q8_K")
    vec_dot.argtypes = [ctypes.c_int, ptr, ctypes.c_size_t, ptr, ctypes.c_size_t, ptr, ctypes.c_size_t, ctypes.c_int]
    n, k, m = 37, 1024, 5
    rng = np.random.default_rng(11)
    matrix = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    blocks = ggml_quantize_rows(matrix, qtype)
    raw = RawTensor("w", qtype, (n, k), torch.from_numpy(blocks))
    x = rng.standard_normal((m, k)).astype(np.float32)
    q8 = np.zeros((m, k // 256 * 292), np.uint8)  # block_q8_K: float d, 256 int8, 16 int16 sums
    want, out = np.zeros((m, n), np.float64), ctypes.c_float()
    for i in range(m):
        cpu.quantize_row_q8_K(x[i].ctypes.data, q8[i].ctypes.data, k)
        for r in range(n):
            vec_dot(k, ctypes.byref(out), 0, blocks[r].ctypes.data, 0, q8[i].ctypes.data, 0, 1)
            want[i, r] = out.value
    got = QdotLinear(raw)(torch.from_numpy(x)).double().numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    exact = x.astype(np.float64) @ dequantize(raw).double().numpy().T
    assert 0 < np.abs(got - exact).max() < 3e-2 * np.abs(exact).max()
