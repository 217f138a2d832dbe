"""shared.models.linear's kernels against the `gguf` package's own dequantizers (numpy, written by llama.cpp's authors);
the unpacking they start from is tests/test_quant.py's."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from shared.files.gguf_loader import RawTensor
from shared.models import linear
from shared.models.linear import (
    INT4_MAX_TOKENS,
    LEAN_INT8_TYPES,
    ConcatLinear,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    QdotLinear,
    SwitchedLinear,
    auto_nbytes,
    lean_kernel,
    lean_nbytes,
    make_linear,
    qdot_kind,
    qdot_takes,
    stored_kernel,
    stored_nbytes,
)
from shared.models.quant import unpack_levels

ROWS, COLS = 48, 512  # 48 rows: a multiple of 16 (int4 kernel); 512 columns: two Q4_K superblocks


def _blocks_kernel(qtype: str) -> type:
    """The kernel of a 4- or 8-bit type's own blocks here: the integer-dot kernels where they run (Q4_0, Q4_1, Q4_K,
    Q5_0, Q6_K, Q8_0 on AVX2 CPUs; tests/test_qdot.py), else int4 (one plane or two) or, for Q6_K, int8 rows."""
    return QdotLinear if qdot_takes(qtype) else Int8Linear if qtype == "Q6_K" else Int4Linear


def _blocks_kind(qtype: str) -> str:
    return qdot_kind(qtype) if qdot_takes(qtype) else ("int4-g32" if qtype in ("Q4_0", "Q4_1", "Q4_K")
                                                                  else "int4x2-g32")


def _raw(qtype: str, seed: int = 0) -> tuple[RawTensor, np.ndarray]:
    """Raw bytes of a ROWS x COLS tensor of qtype, and gguf's float32 dequantization of them."""
    rng = np.random.default_rng(seed)
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):  # gguf cannot quantize these: random blocks with sane fp16 super-scales
        size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]
        blocks = rng.integers(0, 256, (ROWS * COLS // 256, size), dtype=np.uint8)
        scales = (rng.random((blocks.shape[0], 2)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
        if qtype in ("Q4_K", "Q5_K"):
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


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "F16"])
def test_stored_kernel_runs_the_files_numbers(qtype):
    """Each type's own kernel (int4, two int4 planes, int8 rows, dense) times x equals x times the GGUF's own weights
    (gguf's dequantization), up to bf16 activations and scales -- and int8's requantization, which stays well
    inside a bf16-sized error: a wrong nibble order, plane or zero convention would be off by the size of the
    weights themselves. Its bytes are what stored_nbytes plans with."""
    raw, ref = _raw(qtype, seed=1)
    w = stored_kernel(raw)
    expected = {"Q4_0": _blocks_kernel("Q4_0"), "Q4_1": _blocks_kernel("Q4_1"), "Q4_K": _blocks_kernel("Q4_K"),
                "Q8_0": _blocks_kernel("Q8_0"), "Q5_0": _blocks_kernel("Q5_0"), "Q5_1": _blocks_kernel("Q5_1"), "Q5_K": _blocks_kernel("Q5_K"),
                "Q6_K": _blocks_kernel("Q6_K"), "F16": DenseLinear}.get(qtype, Int8Linear)
    assert isinstance(w, expected), w.kind
    if isinstance(w, Int4Linear):  # the levels the kernel packs reproduce the file exactly
        q, scale, low = unpack_levels(raw)
        np.testing.assert_array_equal((q.view(ROWS, -1, 32) * scale[..., None] + low[..., None]).view(ROWS, COLS).numpy(), ref)
    x = torch.randn(5, COLS, generator=torch.Generator().manual_seed(1))
    exact = x.bfloat16().double() @ torch.from_numpy(ref).double().T  # [5, ROWS]
    err = (w(x).double() - exact).abs().max() / exact.abs().max()
    # int8 rows requantize the weights; the integer-dot kernels round the activations to 8 bits per block of 32
    assert err < (2e-2 if isinstance(w, Int8Linear | QdotLinear) else 1e-2), err
    assert w.nbytes == stored_nbytes(qtype, (ROWS, COLS))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_lean_kernel_is_the_smallest_within_the_types_own_error(qtype):
    """lean holds 5- and 6-bit types as int8 rows (1 byte a weight, not two int4 planes' 1.25), but Q5_0 / Q5_1 / Q5_K /
    Q6_K on the integer-dot kernels as their own blocks (0.69 / 0.75 / 0.75 / 0.875): the result stays within the int8 bound
    of the exact product, and its bytes are what lean_nbytes plans with and less than stored's where it differs."""
    raw, ref = _raw(qtype, seed=2)
    w = lean_kernel(raw)
    own_blocks = qtype in ("Q4_1", "Q8_0") or (qtype in ("Q5_0", "Q5_1", "Q5_K", "Q6_K") and qdot_takes(qtype))
    assert qtype in LEAN_INT8_TYPES or own_blocks
    assert isinstance(w, _blocks_kernel(qtype) if own_blocks else Int8Linear), w.kind
    x = torch.randn(5, COLS)
    exact = x.bfloat16().double() @ torch.from_numpy(ref).double().T
    assert (w(x).double() - exact).abs().max() / exact.abs().max() < 2e-2
    assert w.nbytes == lean_nbytes(qtype, (ROWS, COLS)) <= stored_nbytes(qtype, (ROWS, COLS))
    if isinstance(w, Int8Linear) and not isinstance(stored_kernel(raw), Int8Linear):
        assert w.nbytes < stored_nbytes(qtype, (ROWS, COLS))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K"])
def test_quantized_kernels_give_a_row_the_same_numbers_at_any_batch_size(qtype):
    """What the batch-invariant mode relies on (it never pads the quantized kernels): row i of an M-row call equals
    the same row computed alone, for every M up to 40: the kernels as that mode builds them (on an AMX CPU the
    integer-dot kernels take prefill-sized calls to the tiles otherwise: tests/test_qdot.py)."""
    w = make_linear([_raw(qtype, seed=5)[0]], "auto", batch_invariant=True)
    x = torch.randn(40, COLS)
    alone = torch.cat([w(x[i:i + 1]) for i in range(40)])
    for m in range(1, 41):
        assert torch.equal(w(x[:m]), alone[:m]), m


def dense_kind() -> str:
    return make_linear([_raw("F16")[0]], "auto").kind


def test_auto_switches_kernel_by_tokens_and_lean_mode_does_not(monkeypatch):
    raw, _ = _raw("Q5_K")  # two int4 planes where the integer-dot kernels do not run (lean: int8 rows)
    with monkeypatch.context() as patched:  # a CPU where they do not (an AVX512 one where torch's int4 is faster)
        patched.setattr(linear, "qdot_takes", lambda ggml_type: False)
        auto, lean = make_linear([raw], "auto"), make_linear([raw], "lean")
        invariant = make_linear([raw], "auto", batch_invariant=True)
    assert isinstance(auto, SwitchedLinear) and isinstance(lean, Int8Linear)
    x = torch.randn(INT4_MAX_TOKENS, COLS)
    small, large = x[:INT4_MAX_TOKENS - 1], x
    assert torch.equal(auto(small), auto.small(small)) and torch.equal(auto(large), auto.large(large))
    assert isinstance(invariant, Int4Linear)
    # the integer-dot kernels outrun the dense one at every size: where they run, auto keeps no dense copy
    q4_1 = make_linear([_raw("Q4_1")[0]], "auto")
    assert isinstance(q4_1, QdotLinear if qdot_takes("Q4_1") else SwitchedLinear), q4_1.kind
    assert isinstance(make_linear([_raw("F16")[0]], "auto"), DenseLinear)  # float types have no quantized kernel
    q6_k = make_linear([_raw("Q6_K")[0]], "auto")  # elsewhere dense, no slower than int8 rows
    assert isinstance(q6_k, QdotLinear if qdot_takes("Q6_K") else DenseLinear), q6_k.kind
    assert isinstance(make_linear([_raw("Q6_K")[0]], "lean"), QdotLinear if qdot_takes("Q6_K") else Int8Linear)


@pytest.mark.parametrize("mode", ["f32", "bf16", "lean", "auto"])
def test_fused_rows_of_any_type_mix_compute_the_concatenation(mode):
    """q|k|v of three different types (as real Q4_K_M files have: Q5_0, Q5_0, Q8_0 / Q4_K / Q6_K) in every mode:
    the fused linear equals x times the parts' own weights stacked, each part on its own kernel where they differ."""
    parts = [_raw(t, seed=i) for i, t in enumerate(("Q4_K", "Q5_0", "Q5_0", "Q6_K", "Q8_0"))]
    fused = make_linear([raw for raw, _ in parts], mode)
    x = torch.randn(3, COLS)
    expected = x.double() @ torch.from_numpy(np.concatenate([ref for _, ref in parts])).double().T
    err = (fused(x).double() - expected).abs().max() / expected.abs().max()
    assert err < (1e-6 if mode == "f32" else 2e-2), err
    assert fused.out_features == len(parts) * ROWS
    if mode == "lean":  # each type on its lean kernel, the two Q5_0 parts on one
        assert isinstance(fused, ConcatLinear) and [p.kind for p in fused.parts] == [
            _blocks_kind("Q4_K"), _blocks_kind("Q5_0") if qdot_takes("Q5_0") else "int8-rows",
            _blocks_kind("Q6_K") if qdot_takes("Q6_K") else "int8-rows", _blocks_kind("Q8_0")]
        assert fused.parts[1].out_features == 2 * ROWS
    if mode == "auto" and qdot_takes("Q6_K"):  # every type on the integer-dot kernels: no switch, no dense copy
        assert isinstance(fused, ConcatLinear) and [p.kind for p in fused.parts] == [
            _blocks_kind("Q4_K"), _blocks_kind("Q5_0"), _blocks_kind("Q6_K"), _blocks_kind("Q8_0")]
    elif mode == "auto":  # int4 (one or two planes) below the crossover, dense for Q6_K; a
        assert isinstance(fused, SwitchedLinear) and isinstance(fused.small, ConcatLinear)  # prefill copy of the whole
        assert [p.kind for p in fused.small.parts] == [_blocks_kind("Q4_K"), _blocks_kind("Q5_0"), dense_kind(),
                                                       _blocks_kind("Q8_0")]
        assert fused.large.out_features == 5 * ROWS


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


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K", "F16"])
def test_auto_holds_the_bytes_its_plan_counts(qtype):
    """shared.models.memory plans auto against auto_nbytes: what make_linear's auto then holds."""
    raw, _ = _raw(qtype)
    for dtype in (torch.bfloat16, torch.float32):
        assert make_linear([raw], "auto", prefill_dtype=dtype).nbytes == auto_nbytes(qtype, (ROWS, COLS), dtype)


def test_one_fast_bf16_probe_decides_the_default_dtype_the_dense_kernel_and_prepacking():
    """bf16 activations only where the CPU multiplies bf16 natively and the integer-dot kernels (float32 in and out)
    do not run."""
    from shared.kernels import qdot
    from shared.models.device import cpu_has_fast_bf16, default_dtype_name
    from shared.models.linear import dense_dtype

    fast = cpu_has_fast_bf16()
    assert default_dtype_name(torch.device("cpu")) == ("bfloat16" if fast and not qdot.usable() else "float32")
    assert dense_dtype() == (torch.bfloat16 if fast else torch.float32)
    assert DenseLinear(torch.randn(16, 32), torch.bfloat16).prepacked == fast


def test_layers_stack_only_when_every_layer_runs_the_same_kernel_in_the_same_shape():
    """A layer mix (Q4_K beside Q4_1: int4 or two integer-dot kinds of block, as a Q5_K_M file mixes types
    per layer) stays unstacked; same-kind layers stack, each reading its row with the same results."""
    from shared.models.linear import stack_layers

    mixed = [stored_kernel(_raw("Q4_K", seed=1)[0]), stored_kernel(_raw("Q4_1", seed=2)[0])]
    x = torch.randn(2, COLS)
    before = [k(x) for k in mixed]
    if type(mixed[0]) is not type(mixed[1]) or mixed[0].kind != mixed[1].kind:
        assert stack_layers(mixed) is None
    same = [stored_kernel(_raw("Q4_1", seed=s)[0]) for s in (3, 4, 5)]
    alone = [k(x) for k in same]
    stack = stack_layers(same)
    assert stack is not None and all(k.stack is stack for k in same)
    assert all(torch.equal(k(x), y) for k, y in zip(same, alone))
    assert all(torch.equal(k(x), y) for k, y in zip(mixed, before))
