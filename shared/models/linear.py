"""Linear weights in the form the CPU kernels want, built straight from a GGUF tensor's bytes.

Every matmul of TransformerModel goes through one of these: `w(x)` takes x [M, K] (any float dtype) and returns
[M, N] in the weight's compute dtype (bfloat16 for packed/bf16 kernels, float32 for the f32 reference). What
each tensor runs as (`kind`) follows from its GGUF type and the weights mode:

    mode   Q4_0 / Q4_1 / Q4_K                                  other types (Q8_0, Q5_*, Q6_K, F16, BF16, F32, ...)
    auto   int4 g32 below the measured crossover, else prefill  dense
    int4   int4 g32 at every M (0.4x auto's memory)            dense
    bf16   bf16 (oneDNN-prepacked), today's behaviour            bf16 (oneDNN-prepacked)
    f32    float32, the GGUF's numbers exactly                   float32

"dense" is the fastest dense kernel of the CPU at decode sizes (dense_dtype()): oneDNN-prepacked bf16 where the CPU
has native bf16 (AVX512-BF16, AMX), oneDNN-prepacked float32 elsewhere -- on an AVX2 CPU bf16 GEMMs are emulated:
SmolLM2's block matmuls at 32 tokens took 403 ms in bf16 against 75 ms prepacked f32 (plain F.linear f32: 126 ms) on
a 2-core Zen 3. "prefill" is the dense kernel measured fastest for a prefill chunk when the piece loads
(shared.models.crossover.measure_prefill_dtype: prepacked bf16 or f32; f32 on AVX512-BF16 CPUs without AMX), and
the crossover from int4 to it is measured too (apply_measured_crossover).

int4 is torch's `_weight_int4pack_mm_for_cpu`: w = (nibble - 8) * scale + zero per group of 32 along K, fp32
accumulation. Its AVX512 path takes only bf16 activations with bf16 scales/zeros (fp32 scales with bf16
activations are refused: "expected scalar type BFloat16 but found Float"; fp32 activations run scalar code ~25x
slower), so the GGUF's fp16 scale and offset -- Q4_0: d, 0; Q4_1: d, m + 8d; Q4_K: d*sc, 8*d*sc - dmin*mn -- are
rounded to bf16 once. That is the one rounding int4 adds: on SmolLM2 a weight error of rms 2.0e-3 of the weights'
rms (rounding the dequantized weights to bf16, the bf16 mode, costs 1.3e-3). The nibbles are the file's, untouched.
Exactness would be possible: every scale and zero of SmolLM2 is a sum of two bf16 numbers, so two int4 matmuls
(hi and lo scales over the same nibbles) reproduce the GGUF exactly -- at twice int4's cost, which at one token is
about prepacked bf16's (benchmarks/kernels.py prints both), so it is not done. The f32 mode is exact.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from shared.errors import GgufError
from shared.gguf_loader import RawTensor

WEIGHT_MODES = ("auto", "int4", "bf16", "f32")
GROUP = 32  # ggml's block of 4-bit types (Q4_K: a 256-superblock of 8 such groups)
# auto switches from int4 to its prefill kernel at this many tokens in a micro-batch until a piece's load measures
# the crossover (shared.models.crossover); what benchmarks/kernels.py printed on the 2-core Zen 4 (SmolLM2's 120
# block matmuls, 2 threads, fastest of 9): int4 / bf16 time 0.54 at 1 token, 0.97 at 8, 1.25 at 10, 2.36 at 128.
INT4_MAX_TOKENS = 9
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INVARIANT_ROWS = 8  # the batch-invariant mode's fixed M for dense kernels (about one row's cost: memory-bound)
# Bytes per block and elements per block of the types unpacked here with torch (the rest go through gguf.quants).
_BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256), "Q8_0": (34, 32)}


# ---- unpacking GGUF blocks (torch, vectorised) -------------------------------------------------------------------

def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> [...] float32 (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15 in ggml order: low nibbles are elements 0..15, high ones 16..31."""
    out = torch.empty(*qs.shape[:-1], 32, dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=out[..., :16])
    torch.bitwise_right_shift(qs, 4, out=out[..., 16:])
    return out


def unpack_4bit(raw: RawTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K -> (q [N, K] uint8 0..15, scale [N, K/32] f32, low [N, K/32] f32) with, exactly,
    w = q * scale + low   (Q4_0: d*(q-8) -> scale d, low -8d; Q4_1: d*q + m; Q4_K: d*sc*q - dmin*mn)."""
    n, k = raw.shape
    size, per = _BLOCK[raw.ggml_type]
    b = raw.data.reshape(n, k // per, size)
    if raw.ggml_type == "Q4_0":
        d = _f16(b[..., 0:2])
        return _nibbles(b[..., 2:]).reshape(n, k), d, -8.0 * d
    if raw.ggml_type == "Q4_1":
        return _nibbles(b[..., 4:]).reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4])
    # Q4_K: d, dmin fp16; 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks; 128 bytes of nibbles where byte
    # chunk j (32 bytes) holds sub-block 2j in its low nibbles and 2j+1 in its high ones.
    d, dmin, sc = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16].to(torch.int32)
    lo4, hi4, mix = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = torch.cat([lo4 & 0x3F, (mix & 0x0F) | ((lo4 >> 2) & 0x30)], dim=-1).float()  # [N, K/256, 8]
    mins = torch.cat([hi4 & 0x3F, (mix >> 4) | ((hi4 >> 2) & 0x30)], dim=-1).float()
    qs = b[..., 16:].reshape(n, k // per, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, k)  # [N, K/256, 4, 2, 32] -> sub-block order
    return q, (d[..., None] * scales).reshape(n, -1), (-(dmin[..., None] * mins)).reshape(n, -1)


def _apply_groups(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """q [N, K] 0..15, scale / low [N, K/32] -> w = q * scale + low, float32 [N, K] (exact: 4 x 17 bits)."""
    n = q.shape[0]
    return torch.addcmul(low[..., None], q.view(n, -1, GROUP), scale[..., None]).view(n, -1)


def dequantize(raw: RawTensor) -> torch.Tensor:
    """The GGUF's own numbers as float32 in raw.shape (exactly what llama.cpp dequantizes to)."""
    if raw.ggml_type in INT4_TYPES:
        return _apply_groups(*unpack_4bit(raw)).view(raw.shape)
    if raw.ggml_type == "Q8_0":
        b = raw.data.reshape(raw.data.shape[0], -1, 34)
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * _f16(b[..., 0:2])[..., None]).view(raw.shape)
    if raw.ggml_type in ("F32", "F16", "BF16"):
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[raw.ggml_type]
        return raw.data.contiguous().view(dt).float().view(raw.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as np_dequantize

    values = np_dequantize(raw.data.numpy(), GGMLQuantizationType[raw.ggml_type])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(raw.shape)


# ---- the weight kinds --------------------------------------------------------------------------------------------

@functools.cache
def prepacked_bf16_available() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def dense_dtype() -> torch.dtype:
    """The dtype of the auto / int4 modes' dense kernel (prefill-sized micro-batches, non-4-bit types): bf16 where
    oneDNN has a fast bf16 GEMM, else float32 (see the module docstring for the measured gap)."""
    return torch.bfloat16 if prepacked_bf16_available() else torch.float32


def int4_fits(shape: Sequence[int]) -> bool:
    """The int4 kernel's constraints: N divisible by 16, K by the group."""
    n, k = shape
    return n % 16 == 0 and k % GROUP == 0


class Int4Linear:
    """int4 weight-only, group 32: packed [N, K/2] uint8 + scales_and_zeros [K/32, N, 2] bf16; bf16 out."""

    kind = "int4-g32"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor):
        # q [N, K] 0..15, w = q*scale + low per group  ==  (q - 8)*scale + (low + 8*scale): the kernel's form.
        self.out_features, self.in_features = q.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        zero = low + 8.0 * scale  # exact in fp32 for GGUF scales (fp16 values a few binades apart)
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                                          self.scales_and_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


class DenseLinear:
    """A plain matrix: float32 (F.linear, exact) or bf16 (oneDNN-prepacked where the CPU has it, else F.linear).
    prepack_f32: float32 through oneDNN's prepacked GEMM too (the auto modes' dense kernel on CPUs without fast bf16;
    the same fp32 products, summed in oneDNN's order rather than MKL's; the f32 reference mode keeps F.linear).

    fixed_rows: call the kernel only ever on exactly this many rows (the last call zero-padded), so that a row's
    result cannot depend on how many rows came with it (BLAS / oneDNN pick different blockings and reduction
    orders by M, e.g. gemv at M = 1); the batch-invariant mode's dense path."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, fixed_rows: int | None = None,
                 prepack_f32: bool = False):
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.fixed_rows = fixed_rows
        w = weight.to(dtype).contiguous()
        self.prepacked = w.device.type == "cpu" and (
            prepacked_bf16_available() if dtype == torch.bfloat16
            else prepack_f32 and dtype == torch.float32 and torch.backends.mkldnn.is_available())
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, None) if self.prepacked else w
        self.kind = (f"{'bf16' if dtype == torch.bfloat16 else 'f32'}-prepacked" if self.prepacked
                     else str(dtype).removeprefix("torch."))
        if fixed_rows:
            self.kind += f" (rows of {fixed_rows})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.fixed_rows:
            m, r = x.shape[0], self.fixed_rows
            x = F.pad(x, (0, 0, 0, -m % r))  # [ceil(M / r) * r, K]
            return torch.cat([self._mm(chunk) for chunk in x.split(r)])[:m]
        return self._mm(x)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


class SwitchedLinear:
    """The same weight twice: int4 for micro-batches of fewer than `max_tokens` rows, a dense kernel (oneDNN-prepacked
    bf16 or f32: the prefill kernel) from there on."""

    def __init__(self, small: Int4Linear, large: DenseLinear, max_tokens: int):
        self.small, self.large, self.max_tokens = small, large, max_tokens
        self.out_features, self.in_features = small.out_features, small.in_features
        self.kind = f"{small.kind} (< {max_tokens} tokens) | {large.kind}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] < self.max_tokens else self.large(x)

    @property
    def nbytes(self) -> int:
        return self.small.nbytes + self.large.nbytes


class ConcatLinear:
    """Output-concatenation of weights that cannot share one kernel (e.g. q|k|v of different GGUF types)."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.kind = " + ".join(dict.fromkeys(p.kind for p in parts))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [p(x) for p in self.parts]
        dtype = torch.promote_types(*[o.dtype for o in outs]) if len(outs) > 1 else outs[0].dtype
        return torch.cat([o.to(dtype) for o in outs], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Linear = Int4Linear | DenseLinear | SwitchedLinear | ConcatLinear


def make_linear(raws: list[RawTensor], mode: str, device: torch.device | str = "cpu",
                batch_invariant: bool = False, prefill_dtype: torch.dtype | None = None) -> Linear:
    """One linear for the row-concatenation of `raws` (q|k|v, gate|up, or a single matrix), in `mode`.
    prefill_dtype: auto's dense kernel above the int4 crossover (bf16 or float32, prepacked; None: dense_dtype()).

    batch_invariant: a row's result must not depend on how many rows a call has: auto never switches kernels
    (int4 at every size, as in mode int4; its per-row results were checked equal for any M), dense kernels
    run on fixed blocks of INVARIANT_ROWS rows."""
    if mode not in WEIGHT_MODES:
        raise GgufError(f"unknown weights mode {mode!r}; choose one of {', '.join(WEIGHT_MODES)}")
    types = {r.ggml_type for r in raws}
    k = raws[0].shape[1]
    n = sum(r.shape[0] for r in raws)
    rows = INVARIANT_ROWS if batch_invariant else None
    if len(types) > 1:
        return ConcatLinear([make_linear([r], mode, device, batch_invariant, prefill_dtype) for r in raws])
    if mode == "f32" or torch.device(device).type != "cpu":
        dtype = torch.float32 if mode == "f32" else torch.bfloat16
        return DenseLinear(torch.cat([dequantize(r) for r in raws]).to(device), dtype, rows)
    data = raws[0].data if len(raws) == 1 else torch.cat([r.data for r in raws])  # rows = output features
    raw = RawTensor("+".join(r.name for r in raws), raws[0].ggml_type, (n, k), data)
    dense = torch.bfloat16 if mode == "bf16" else dense_dtype()
    if raw.ggml_type not in INT4_TYPES or mode == "bf16" or not int4_fits(raw.shape):
        return DenseLinear(dequantize(raw), dense, rows, prepack_f32=True)
    q, scale, low = unpack_4bit(raw)
    small = Int4Linear(q, scale, low)
    if mode == "int4" or batch_invariant:
        return small
    large = DenseLinear(_apply_groups(q, scale, low), prefill_dtype or dense, prepack_f32=True)
    return SwitchedLinear(small, large, INT4_MAX_TOKENS)


class QuantizedRows:
    """An embedding table kept as the GGUF's bytes; looking rows up dequantizes just them (exact, any type)."""

    kind = "gguf-rows"

    def __init__(self, raw: RawTensor):
        self.raw = raw
        self.num_rows, self.dim = raw.shape

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, D] float32, the GGUF's own values."""
        rows = self.raw.data.index_select(0, ids.to(self.raw.data.device))  # kept on the CPU, as mapped
        return dequantize(RawTensor(self.raw.name, self.raw.ggml_type, (ids.numel(), self.dim), rows)).to(ids.device)

    @property
    def nbytes(self) -> int:
        return self.raw.data.nbytes
