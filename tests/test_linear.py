"""shared.models.linear against the `gguf` package's own dequantizers (numpy, written by llama.cpp's authors)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from shared.gguf_loader import RawTensor
from shared.models.linear import (
    INT4_MAX_TOKENS,
    DenseLinear,
    Int4Linear,
    SwitchedLinear,
    dense_dtype,
    dequantize,
    make_linear,
    unpack_4bit,
)

ROWS, COLS = 48, 512  # 48 rows: a multiple of 16 (int4 kernel); 512 columns: two Q4_K superblocks


def _raw(qtype: str, seed: int = 0) -> tuple[RawTensor, np.ndarray]:
    """Raw bytes of a ROWS x COLS tensor of qtype, and gguf's float32 dequantization of them."""
    rng = np.random.default_rng(seed)
    if qtype in ("Q4_K", "Q6_K"):  # gguf cannot quantize these: random blocks with sane fp16 super-scales
        size = {"Q4_K": 144, "Q6_K": 210}[qtype]
        blocks = rng.integers(0, 256, (ROWS * COLS // 256, size), dtype=np.uint8)
        scales = (rng.random((blocks.shape[0], 2)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
        if qtype == "Q4_K":
            blocks[:, 0:4] = scales
        else:
            blocks[:, -2:] = scales[:, :2]
        data = blocks.reshape(ROWS, -1)
    elif qtype == "F16":
        data = (rng.standard_normal((ROWS, COLS)) * 0.1).astype(np.float16).view(np.uint8)
    else:
        data = quantize((rng.standard_normal((ROWS, COLS)) * 0.1).astype(np.float32), GGMLQuantizationType[qtype])
    ref = gguf_dequantize(data, GGMLQuantizationType[qtype]).reshape(ROWS, COLS).astype(np.float32)
    return RawTensor("w", qtype, (ROWS, COLS), torch.from_numpy(np.ascontiguousarray(data)).view(ROWS, -1)), ref


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K", "F16"])
def test_dequantize_equals_gguf_exactly(qtype):
    raw, ref = _raw(qtype)
    ours = dequantize(raw).numpy()
    assert np.abs(ref).max() > 0  # not an all-zero tensor
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_kernel_runs_the_files_nibbles(qtype):
    """The packed int4 weight times x equals x times the GGUF's own weights, up to bf16 activations/scales: a
    wrong nibble order or scale/zero convention would be off by the size of the weights themselves."""
    raw, ref = _raw(qtype, seed=1)
    q, scale, low = unpack_4bit(raw)
    w = Int4Linear(q, scale, low)
    x = torch.randn(5, COLS)
    exact = x.bfloat16().double() @ torch.from_numpy(ref).double().T  # [5, ROWS]
    err = (w(x).double() - exact).abs().max() / exact.abs().max()
    assert err < 1e-2, err


def test_auto_switches_kernel_by_tokens_and_int4_mode_does_not():
    raw, _ = _raw("Q4_1")
    auto, int4 = make_linear([raw], "auto"), make_linear([raw], "int4")
    assert isinstance(auto, SwitchedLinear) and isinstance(int4, Int4Linear)
    x = torch.randn(INT4_MAX_TOKENS, COLS)
    small, large = x[:INT4_MAX_TOKENS - 1], x
    assert torch.equal(auto(small), auto.small(small)) and torch.equal(auto(large), auto.large(large))
    assert isinstance(make_linear([raw], "auto", batch_invariant=True), Int4Linear)
    assert isinstance(make_linear([_raw("Q8_0")[0]], "auto"), DenseLinear)


def test_fused_rows_of_different_types_still_run_each_as_its_own_kind():
    a, ref_a = _raw("Q4_1", seed=2)
    b, ref_b = _raw("Q8_0", seed=3)
    fused = make_linear([a, b], "f32")
    x = torch.randn(3, COLS)
    expected = x @ torch.from_numpy(np.concatenate([ref_a, ref_b])).T
    torch.testing.assert_close(fused(x), expected, rtol=0, atol=1e-4)
    assert fused.out_features == 2 * ROWS
    # q|k|v of mixed types: int4 for the Q4_1 rows, the CPU's dense kernel (bf16 or f32, dense_dtype) for the Q8_0 rows
    kinds = make_linear([a, b], "int4").kind
    dense = {torch.bfloat16: "bf16", torch.float32: "f32"}[dense_dtype()]
    assert "int4" in kinds and dense in kinds, kinds


def test_prepacked_f32_is_the_f32_product_in_another_summation_order():
    """The auto modes' dense kernel on CPUs without fast bf16 (oneDNN-prepacked float32) computes the same fp32
    products as F.linear, summed in its own order: equal to float32 rounding, at decode and prefill sizes."""
    _, ref = _raw("Q8_0", seed=4)
    w = torch.from_numpy(ref)
    dense = DenseLinear(w, torch.float32, prepack_f32=True)
    assert dense.kind == ("f32-prepacked" if torch.backends.mkldnn.is_available() else "float32"), dense.kind
    for m in (1, 7, 64):
        x = torch.randn(m, COLS)
        torch.testing.assert_close(dense(x), x @ w.T, rtol=1e-5, atol=1e-4)
    assert DenseLinear(w, torch.float32).kind == "float32"  # the f32 reference mode keeps F.linear
