"""Linear weights in the form the CPU kernels want, built straight from a GGUF tensor's bytes.

Every matmul of TransformerModel goes through one of these: `w(x)` takes x [M, K] (any float dtype) and returns
[M, N] in the weight's compute dtype (bfloat16 for the quantized and bf16 kernels, float32 for the f32 reference).
What each tensor runs as (`kind`) follows from its GGUF type and the weights mode:

    mode   Q4_0 / Q4_1 / Q4_K     Q8_0 / Q5_0 / Q5_1 / Q5_K     other quantized types     F16 / BF16 / F32
    lean   int4 g32               Q8_0: int4 g32, two planes;   int8, a scale per row     dense
                                  Q5_*: int8, a scale per row
    auto   lean's int4 below the measured crossover, prefill     dense                     dense
           from there on (when the memory budget holds auto's copies beside the KV cache; shared.models.memory
           decides, else the piece loads lean)
    bf16   bf16 (oneDNN-prepacked) for every type
    f32    float32, the GGUF's numbers exactly (the reference)

Where the integer-dot kernels run (CPUs whose torch kernels are AVX2: qdot_takes), Q4_0 / Q4_1 / Q8_0 take them
(QdotLinear) wherever the table says int4, Q5_0 / Q5_1 in both modes (their own blocks, smaller than int8 rows), and
Q4_K and Q5_K in both (rewritten to Q4_1 / Q5_1 blocks, their scales rounded to fp16), Q6_K in both (q6_16 blocks,
0.875 bytes a weight) and Q2_K / Q3_K in both (their own superblocks of 256, 1.0x / 1.036x the file's bytes): the
file's numbers,
multiplied as llama.cpp does (shared.kernels.qdot). They
outrun the dense kernel at every size, so auto runs them alone there: no dense copy, no crossover.

So a stage's memory tracks its share of the file in lean: int4 is 0.625 bytes a weight (Q4_0 0.56, Q4_1 0.625,
Q4_K 0.56 in the file), two int4 planes 1.25 (Q8_0 1.06), int8 rows 1.0 (Q5_0 0.69, Q5_K 0.69, Q6_K 0.82, Q3_K 0.43).
Lean holds a 5-bit type as int8 rows rather than two exact int4 planes: a per-row int8 step is a fraction of the
type's own per-block 5-bit step, and the K-quant presets on rows that are not a multiple of 256 (SmolLM2's 576) are
mostly Q5_0 / Q5_1.

"dense" is the fastest dense kernel of the CPU at decode sizes (dense_dtype()): oneDNN-prepacked bf16 where the CPU
has native bf16 (AVX512-BF16, AMX), oneDNN-prepacked float32 elsewhere (bf16 GEMMs are emulated on AVX2 CPUs;
benchmarks/kernels.py prints both). "prefill" is the dense kernel measured fastest for a prefill chunk when the
piece loads (shared.models.crossover), and so is the crossover from the quantized kernel to it.

int4 is torch's `_weight_int4pack_mm_for_cpu`: w = (nibble - 8) * scale + zero per group of 32 along K, fp32
accumulation. Its AVX512 path takes only bf16 activations with bf16 scales/zeros, so the GGUF's fp16 scale and
offset -- Q4_0: d, 0; Q4_1: d, m + 8d; Q4_K: d*sc, 8*d*sc - dmin*mn; Q8_0 and Q5_*: 16d and d over the high and
low nibbles of their levels -- are rounded to bf16 once. That is the one rounding int4 adds (of the order of rounding the dequantized
weights to bf16, the bf16 mode); the levels are the file's, untouched. int8 is `_weight_int8pack_mm` (one scale per
output row), the only kernel here that requantizes (Int8Linear). The f32 mode is exact.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.config import WEIGHT_MODES
from shared.errors import CapabilityMissing, GgufError
from shared.files.gguf_loader import RawTensor
from shared.kernels import qdot
from shared.models.device import cpu_has_fast_bf16
from shared.models.quant import (
    BLOCKS,
    FLOAT_TYPES,
    GROUP,
    GROUP_TYPES,
    dequantize,
    k_low_levels,
    q6_k_levels,
    unpack_levels,
)

# auto switches from the quantized kernel to its prefill kernel at this many tokens in a micro-batch until a piece's
# load measures the crossover (shared.models.crossover); benchmarks/kernels.py prints the curve it comes from.
INT4_MAX_TOKENS = 9
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # a nibble x scale + low per group of 32: one int4 plane, as stored
INT4_PAIR_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K")  # up to 8 bits x scale + low per group of 32: two int4 planes
assert set(INT4_TYPES + INT4_PAIR_TYPES) == set(GROUP_TYPES)  # the int4 kernels take unpack_levels' numbers
# The types QdotLinear takes where the integer-dot kernels run (qdot.usable()), and the op each runs on.
# QdotLinear rewrites four: Q4_K runs as Q4_1 blocks {d*sc, -dmin*mn} per group of 32 (the two rounded to fp16 once,
# as llama.cpp rounds Q8_1's; int4 rounds them to bf16); Q6_K as q6_16 blocks {d, the two int8 scales, its 6-bit
# levels} per group of 32 (its own numbers, 7 bits a weight); Q5_0 and Q5_1 as their own bytes, the fifth bits after
# the nibbles.
# Q2_K and Q3_K keep their superblocks of 256 (_k_low_blocks: 84 and 114 bytes, the file's 84 and 110).
QDOT_TYPES = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q4_K": "q4_1",
              "Q5_K": "q5_1", "Q6_K": "q6_16", "Q2_K": "q2_k", "Q3_K": "q3_k"}
# Int4Linear's two-plane zeros, in units of the group's scale, for the types whose low is a fixed multiple of it
# (Q8_0: -128 scale, Q5_0: -16 scale): z_hi + z_lo = low / scale + 136.
_PAIR_ZEROS = {"Q8_0": (0.0, 8.0), "Q5_0": (128.0, -8.0)}
# Every other quantized type (IQ*, TQ*, MXFP4, ...) runs as int8 with one scale per row, and so do QDOT_TYPES where
# the integer-dot kernels do not run (but those of INT4_TYPES + INT4_PAIR_TYPES).
INVARIANT_ROWS = 8  # the batch-invariant mode's fixed M for dense kernels (about one row's cost: memory-bound)


# ---- the weight kinds --------------------------------------------------------------------------------------------

@functools.cache
def dense_dtype() -> torch.dtype:
    """The dtype of the auto / int4 modes' dense kernel (prefill-sized micro-batches, non-4-bit types): bf16 where
    oneDNN has a fast bf16 GEMM, else float32 (see the module docstring for the measured gap)."""
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def int4_fits(shape: Sequence[int]) -> bool:
    """The int4 kernel's constraints: N divisible by 16, K by the group."""
    n, k = shape
    return n % 16 == 0 and k % GROUP == 0


class Int4Linear:
    """int4 weight-only, group 32: packed [N, planes * K/2] uint8 + scales_and_zeros [planes * K/32, N, 2] bf16;
    bf16 out. One plane holds a 4-bit type's nibbles as stored. Two planes hold an 8-bit type exactly: level q in
    0..255 = 16 hi + lo, so w = q*scale + low = (16 scale) hi + scale lo + low, i.e. the kernel runs over K twice
    (x repeated) with the high nibbles' groups first -- one call, fp32 accumulation, one bf16 rounding at the end."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, planes: int = 1,
                 pair_zeros: tuple[float, float] | None = None):
        # q [N, K] levels (0..15 for one plane, 0..255 for two), w = q*scale + low per group. The kernel's form per
        # plane is (nibble - 8) * s + z, so two planes need z_hi + z_lo = low + 136 scale: z_hi = 128 scale and
        # z_lo = low + 8 scale, or pair_zeros (z_hi, z_lo) in units of scale where low is a fixed multiple of it --
        # powers of two, which bf16 rounds exactly as it rounds the scale (no error beyond the scale's own).
        self.out_features, self.in_features = q.shape
        self.planes = planes
        self.kind = "int4-g32" if planes == 1 else "int4x2-g32"
        if planes == 1:
            nibbles, scales, zeros = q, scale, low + 8.0 * scale  # exact in fp32 (fp16 values a few binades apart)
        else:
            nibbles = torch.cat([q >> 4, q & 0x0F], dim=1)  # [N, 2K]: high nibbles, then low ones
            scales = torch.cat([16.0 * scale, scale], dim=1)
            z_hi, z_lo = ((128.0 * scale, low + 8.0 * scale) if pair_zeros is None
                          else (pair_zeros[0] * scale, pair_zeros[1] * scale))
            zeros = torch.cat([z_hi, z_lo], dim=1)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), 1)
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()

    STACKED = ("packed", "scales_and_zeros")  # what stack_layers stacks
    stack: LayerStack | None = None  # set by stack_layers: this weight is layer `index` of a stack
    index: int = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.planes == 2:
            x = torch.cat([x, x], dim=-1)
        packed, scales = _stacked(self)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


@dataclass
class LayerStack:
    """Several layers' kernels of one kind and shape (Int4Linear or QdotLinear) as one [L, ...] tensor per weight
    field (the kernel class's STACKED); each kernel reads its layer's row."""

    tensors: dict[str, torch.Tensor]


def stack_layers(kernels: list[Int4Linear] | list[QdotLinear]) -> LayerStack | None:
    """Stack the kernels (one per layer) when they share class, kind and shapes; each then reads its row. None: left
    as they are."""
    if len(kernels) < 2 or len({type(k) for k in kernels}) != 1:  # a mix (layers of other types) stays unstacked
        return None
    fields = kernels[0].STACKED
    if len({(k.kind, *(getattr(k, f).shape for f in fields)) for k in kernels}) != 1:
        return None
    # filled layer by layer, each layer's own tensor dropped once copied: one layer's bytes beside the stack at most
    # (torch.stack would hold every layer's tensor and the stack at once while loading)
    stack = LayerStack({f: torch.empty((len(kernels), *getattr(kernels[0], f).shape), dtype=getattr(kernels[0], f).dtype)
                        for f in fields})
    for i, k in enumerate(kernels):
        for f in fields:
            stack.tensors[f][i].copy_(getattr(k, f))
            setattr(k, f, stack.tensors[f][i])
        k.stack, k.index = stack, i
    return stack


def _stacked(kernel: Int4Linear | QdotLinear) -> tuple[torch.Tensor, ...]:
    """The kernel's weight tensors (its STACKED fields), read from its stack where it has one: a compiled step then
    takes the one stack tensor as its input rather than one view per layer."""
    if kernel.stack is None:
        return tuple(getattr(kernel, f) for f in kernel.STACKED)
    return tuple(kernel.stack.tensors[f][kernel.index] for f in kernel.STACKED)


class QdotLinear:
    """A matrix of one of QDOT_TYPES kept as the GGUF's blocks, multiplied by integer dot products against activations
    quantized to 8 bits per block (shared.kernels.qdot: llama.cpp's scheme, on CPUs whose torch kernels are AVX2).
    blocks [ceil(N/8), K/32 * 8 * bytes] uint8: Q4_1's 20-byte blocks, Q4_0's rewritten to them (its offset -8d, exact
    in fp16) and Q4_K's (_rewritten_blocks); Q8_0's 34-byte blocks; Q5_0's and Q5_1's own 22 / 24 bytes, reordered;
    Q6_K as 28-byte q6_16 blocks (d, an int8 scale per half, 6-bit levels); Q2_K and Q3_K as their own superblocks of
    256 (_k_low_blocks: 84 and 114 bytes); 8 rows' interleaved (qdot.interleave). float32 out.
    Where AMX runs (qdot.amx_rows()), a call of q4_1, q8_0 or q6_16 blocks with at least tile_rows rows runs on the
    tiles (the weights dequantized to bf16 on the fly, bf16 products): a row's result then depends on whether its call
    had tile_rows rows, and on nothing else. tile_rows=0 (the batch-invariant mode's): the integer-dot path for every
    M, a row's result independent of the other rows."""

    def __init__(self, raw: RawTensor, tile_rows: int | None = None):
        if (why := qdot.load()) is not None:
            raise CapabilityMissing(f"the integer-dot kernels cannot run here: {why}")
        self.out_features, self.in_features = n, k = raw.shape
        self.op = QDOT_TYPES[raw.ggml_type]
        # a plain int: compiled decode graphs take it as a constant
        self.tile_rows = _tile_rows(self.op, tile_rows)
        self.kind = qdot_kind(raw.ggml_type, self.tile_rows)
        # owned, not a view of the mapped file; made rows_at_once rows (whole groups of 8) at a time
        self.blocks = torch.empty(-(-n // qdot.GROUP_ROWS), qdot.GROUP_ROWS * qdot.row_bytes(self.op, k),
                                  dtype=torch.uint8)
        for rows, part in _row_slices(raw):
            groups = slice(rows.start // qdot.GROUP_ROWS, -(-rows.stop // qdot.GROUP_ROWS))
            self.blocks[groups] = qdot.interleave(self.op, _op_blocks(part).reshape(rows.stop - rows.start, -1))

    STACKED = ("blocks",)  # what stack_layers stacks
    stack: LayerStack | None = None  # set by stack_layers: this weight is layer `index` of a stack
    index: int = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        (blocks,) = _stacked(self)
        # a bf16 piece stays bf16 (as int4 does)
        return qdot.mm(self.op, x, blocks, self.out_features, self.tile_rows).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


def _tile_rows(op: str, tile_rows: int | None) -> int:
    """QdotLinear's rows from which a call runs on the AMX tiles (None: qdot.amx_rows()'s, 0: never)."""
    return (qdot.amx_rows() if tile_rows is None else tile_rows) if op in qdot.AMX_OPS else 0


def qdot_kind(ggml_type: str, tile_rows: int | None = None) -> str:
    """What QdotLinear runs a matrix of this type as (its kind, which /info shows per tensor): "q4_k-dot-q8", and
    where a call from some rows on runs on the AMX tiles "q4_k-dot-q8 | amx-bf16 from 32 rows". tile_rows: as
    QdotLinear's."""
    rows = _tile_rows(QDOT_TYPES[ggml_type], tile_rows)
    return f"{ggml_type.lower()}-dot-q8" + (f" | amx-bf16 from {rows} rows" if rows else "")


WEIGHTS_AT_ONCE = 1 << 22  # a matrix is converted at load this many weights at a time: its float copies stay ~16 MiB


def rows_at_once(k: int) -> int:
    """About WEIGHTS_AT_ONCE weights' rows, a multiple of the integer-dot kernels' groups of 8 rows."""
    return max(GROUP, WEIGHTS_AT_ONCE // k // qdot.GROUP_ROWS * qdot.GROUP_ROWS)


def _row_slices(raw: RawTensor) -> Iterator[tuple[slice, RawTensor]]:
    """raw's rows rows_at_once at a time: (their slice, them as a RawTensor of their own)."""
    n, k = raw.shape
    step = rows_at_once(k)
    for r0 in range(0, n, step):
        rows = slice(r0, min(n, r0 + step))
        yield rows, RawTensor(raw.name, raw.ggml_type, (rows.stop - r0, k), raw.data[rows])


def _op_blocks(raw: RawTensor) -> torch.Tensor:
    """raw's blocks in its qdot op's layout [N, K/32, BLOCK_BYTES] (Q2_K / Q3_K: [N, K/256, BLOCK_BYTES]): Q4_0's with
    their offset spelled out ({d, qs} -> {d, -8d, qs}, Q4_1's), Q4_1's and Q8_0's as stored, the rest rewritten
    (_rewritten_blocks, _k_low_blocks)."""
    if raw.ggml_type in ("Q2_K", "Q3_K"):
        return _k_low_blocks(raw)
    if raw.ggml_type in ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"):
        return _rewritten_blocks(raw)
    n, k = raw.shape
    data = raw.data.reshape(n, k // GROUP, BLOCKS[raw.ggml_type][0])
    if raw.ggml_type == "Q4_0":
        low = (-8.0 * data[..., 0:2].contiguous().view(torch.float16)).view(torch.uint8)
        data = torch.cat([data[..., 0:2], low, data[..., 2:]], dim=-1)
    return data


def _rewritten_blocks(raw: RawTensor) -> torch.Tensor:
    """Q5_0 / Q5_1 -> their q5_0 / q5_1 blocks [N, K/32, 22 / 24]: the same bytes, the 4 of fifth bits moved after
    the 16 of nibbles (qdot.interleave then spreads them for the kernel). Q4_K -> Q4_1 blocks
    [N, K/32, 20]: for each group of 32 of a superblock, {d*sc, -dmin*mn, its nibbles}, the scale and offset rounded
    to fp16 (a relative error under 2^-11 of the group's scale; llama.cpp rounds its Q8_1 activations' the same way);
    Q5_K -> q5_1 blocks [N, K/32, 24] the same way, its fifth bits after the nibbles (0.75 bytes a weight, the file's
    0.69).
    Q6_K -> q6_16 blocks [N, K/32, 28]: {its superblock's fp16 d, the int8 scales of elements 0..15 and 16..31, the
    levels' low nibbles as Q4_1's, their high 2 bits: bits 2j, 2j + 1 of byte 4h + b are element 16h + 4j + b's}, the
    same numbers."""
    n, k = raw.shape
    if raw.ggml_type in ("Q5_0", "Q5_1"):  # {d, (m,) qh, qs} -> {d, (m,) qs, qh}
        b = raw.data.reshape(n, k // GROUP, BLOCKS[raw.ggml_type][0])
        at = 2 if raw.ggml_type == "Q5_0" else 4
        return torch.cat([b[..., :at], b[..., at + 4:], b[..., at:at + 4]], dim=-1)
    if raw.ggml_type == "Q6_K":
        size, per = BLOCKS["Q6_K"]
        nb = k // GROUP
        levels, _ = q6_k_levels(raw)
        u = (levels.view(n, nb, GROUP).to(torch.int16) + 32).to(torch.uint8)  # 0..63
        sb = raw.data.reshape(n, k // per, size)
        d = sb[..., None, 208:210].expand(n, k // per, per // GROUP, 2).reshape(n, nb, 2)
        sc = sb[..., 192:208].reshape(n, nb, 2)
        nibbles = (u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)
        high = ((u >> 4).view(n, nb, 2, 4, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1))
        high = high.sum(3, dtype=torch.uint8).view(n, nb, 8)  # [.., h, j, b] summed over j -> byte 4h + b
        return torch.cat([d, sc, nibbles, high], dim=-1)
    q, scale, low = unpack_levels(raw)
    q = q.view(n, k // GROUP, GROUP)
    d, m = scale.to(torch.float16), low.to(torch.float16)
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise GgufError(f"{raw.name}: a {raw.ggml_type} scale or offset past fp16's range; load it with --weights f32")
    nibbles = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)  # Q4_1's order: elements 0..15 low, 16..31 high
    blocks = [d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), nibbles]
    if raw.ggml_type == "Q5_K":  # q5_1's 4 bytes of fifth bits: bit i of the little-endian 32 is element i's
        fifth = ((q >> 4) & 1).view(n, k // GROUP, 4, 8) << torch.arange(8, dtype=torch.uint8)
        blocks.append(fifth.sum(-1, dtype=torch.uint8))
    return torch.cat(blocks, dim=-1)


def _k_low_blocks(raw: RawTensor) -> torch.Tensor:
    """Q2_K / Q3_K -> their q2_k / q3_k rows [N, K/256, 84 / 114] (qdot.cpp's header): the file's d (and dmin), its 16
    scales as bytes (Q2_K's as stored; Q3_K's unpacked from 6 bits to int8 less 32: 4 bytes more, 1.036x the file's
    110), and its levels regrouped: bits 2i of byte 4j + b hold element 16j + 4i + b's low 2 bits, and for Q3_K bit
    4h + i of byte 4p + b of the 32 after them element 32p + 16h + 4i + b's third bit. The same numbers."""
    n, k = raw.shape
    nb = k // 256
    q, scales, d, dmin = k_low_levels(raw)
    u = q.view(n, nb, 16, 4, 4)  # [.., sub-block j, i, b]
    low2 = ((u & 3) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)).sum(3, dtype=torch.uint8)
    parts = [d.half()[..., None].view(torch.uint8)]
    if dmin is not None:
        parts += [dmin.half()[..., None].view(torch.uint8), scales.view(n, nb, 16).to(torch.uint8)]
    else:
        parts.append(scales.view(n, nb, 16).to(torch.int8).view(torch.uint8))
    parts.append(low2.reshape(n, nb, 64))
    if dmin is None:
        third = (q.view(n, nb, 8, 2, 4, 4) >> 2) & 1  # [.., p, h, i, b]
        shifts = torch.arange(8, dtype=torch.uint8).view(2, 4, 1)
        parts.append((third << shifts).sum((3, 4), dtype=torch.uint8).reshape(n, nb, 32))
    return torch.cat(parts, dim=-1)


def qdot_takes(ggml_type: str) -> bool:
    """Whether a matrix of this type runs on the integer-dot kernels here (QdotLinear)."""
    return ggml_type in QDOT_TYPES and qdot.usable()


class Int8Linear:
    """int8 weight-only with one bf16 scale per output row (`_weight_int8pack_mm`): the types whose levels are not a
    nibble or a byte per group of 32 (Q5_*, Q6_K, Q2_K, Q3_K, IQ*, ...) where no integer-dot kernel takes them.
    Not exact: the GGUF's values are requantized to 255 levels of their row's absolute maximum (an error a few times
    smaller than the type's own step for 5/6-bit types, far smaller for 2/3/4-bit ones; tests/test_real_files.py holds
    it to llama.cpp's logits).
    A row's result does not depend on the other rows of the call (checked for every M in tests/test_linear.py)."""

    kind = "int8-rows"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.weight, self.scales = self._rows(weight)

    @staticmethod
    def _rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [N, K] -> (int8 [N, K], bf16 scales [N]): each row on its own."""
        scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        return torch.round(weight / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8), scale

    @classmethod
    def from_raw(cls, raw: RawTensor) -> Int8Linear:
        """The same numbers as Int8Linear(dequantize(raw)), dequantized rows_at_once rows at a time (a whole 128k x 4096
        matrix in float32 would be 2 GiB beside the int8 one)."""
        self = cls.__new__(cls)
        self.out_features, self.in_features = n, k = raw.shape
        self.weight, self.scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=torch.bfloat16)
        for rows, part in _row_slices(raw):
            self.weight[rows], self.scales[rows] = cls._rows(dequantize(part))
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes


class DenseLinear:
    """A plain matrix: float32 (F.linear, exact) or bf16 (oneDNN-prepacked where bf16 is fast, else F.linear).
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
            cpu_has_fast_bf16() if dtype == torch.bfloat16
            else prepack_f32 and dtype == torch.float32 and torch.backends.mkldnn.is_available())
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, None) if self.prepacked else w
        self.handle = _register_prepacked(self.weight) if self.prepacked else -1
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
            if torch.compiler.is_compiling():  # a graph cannot take the opaque weight: the op finds it by its handle
                return torch.ops.stagemesh_dense.prepacked_mm(x, self.handle, self.out_features)
            # eagerly, oneDNN's own op: a cheaper call than the custom op prepacked_mm
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


# Every live oneDNN-prepacked weight by a handle (an int) of its own. A prepacked weight is an opaque oneDNN tensor
# that torch.compile cannot take as a graph input, so the compiled decode step calls prepacked_mm with the handle, a
# constant of its graph, and the op finds the weight here. Weak: the entry goes with its DenseLinear.
_PREPACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_handles = itertools.count()


def _register_prepacked(weight: torch.Tensor) -> int:
    handle = next(_handles)
    _PREPACKED[handle] = weight
    return handle


@torch.library.custom_op("stagemesh_dense::prepacked_mm", mutates_args=(),
                         schema="(Tensor x, int handle, int n) -> Tensor")
def prepacked_mm(x: torch.Tensor, handle: int, n: int) -> torch.Tensor:
    """x [M, K] @ the oneDNN-prepacked weight [n, K] registered as `handle` -> [M, n] in x's dtype (the weight's).
    An op of its own, so a compiled graph calls it in place rather than breaking around it (inductor does not lower
    oneDNN's prepacked linear): the real Q4_K_M files keep some matrices dense."""
    return torch.ops.mkldnn._linear_pointwise(x, _PREPACKED[handle], None, "none", [], "")


@prepacked_mm.register_fake
def _(x: torch.Tensor, handle: int, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


class SwitchedLinear:
    """The same weight twice: its quantized kernel for micro-batches of fewer than `max_tokens` rows, a dense copy
    (oneDNN-prepacked bf16 or f32: the prefill kernel) from there on."""

    def __init__(self, small: Linear, large: DenseLinear, max_tokens: int):
        self.small, self.large, self.max_tokens = small, large, max_tokens
        self.out_features, self.in_features = small.out_features, small.in_features
        self.kind = f"{small.kind} (< {max_tokens} tokens) | {large.kind}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] < self.max_tokens else self.large(x)

    @property
    def nbytes(self) -> int:
        return self.small.nbytes + self.large.nbytes


class ConcatLinear:
    """Output-concatenation of weights that cannot share one kernel (q|k|v or gate|up of different GGUF types, any
    number of them); the parts' outputs are cast to the widest of their dtypes."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.kind = " + ".join(dict.fromkeys(p.kind for p in parts))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [p(x) for p in self.parts]
        dtype = functools.reduce(torch.promote_types, (o.dtype for o in outs))
        return torch.cat([o.to(dtype) for o in outs], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Linear = Int4Linear | QdotLinear | Int8Linear | DenseLinear | SwitchedLinear | ConcatLinear


def stored_kernel(raw: RawTensor, fixed_rows: int | None = None) -> Int4Linear | QdotLinear | Int8Linear | DenseLinear:
    """The kernel that runs one GGUF type from (about) its stored size: the integer-dot kernels for QDOT_TYPES
    where they run (qdot_takes), else int4 for 4-bit types, two int4 planes for Q8_0 (both exact up to bf16
    scales); int8 per row for every other quantized type, and the dense kernel (dense_dtype()) for float types.
    fixed_rows: as DenseLinear's (the batch-invariant mode's); the quantized kernels' rows are independent of M, but
    for QdotLinear's AMX path, which fixed_rows turns off."""
    if raw.ggml_type in FLOAT_TYPES:
        return DenseLinear(dequantize(raw), dense_dtype(), fixed_rows, prepack_f32=True)
    if qdot_takes(raw.ggml_type):
        return QdotLinear(raw, tile_rows=0 if fixed_rows else None)
    if raw.ggml_type in INT4_TYPES + INT4_PAIR_TYPES and int4_fits(raw.shape):
        return Int4Linear(*unpack_levels(raw), planes=1 if raw.ggml_type in INT4_TYPES else 2,
                          pair_zeros=_PAIR_ZEROS.get(raw.ggml_type))
    return Int8Linear.from_raw(raw)


# lean: int8 rows (1 byte a weight) where stored_kernel holds more: two int4 planes (1.25)
LEAN_INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")


def _lean_int8(ggml_type: str, shape: Sequence[int]) -> bool:
    n, k = math.prod(shape[:-1]), shape[-1]
    return ggml_type in LEAN_INT8_TYPES and _int8_rows_nbytes(n, k) < stored_nbytes(ggml_type, shape)


def lean_kernel(raw: RawTensor, fixed_rows: int | None = None) -> Int4Linear | QdotLinear | Int8Linear | DenseLinear:
    """lean's kernel, the least memory within the fidelity thresholds: stored_kernel, but int8 rows for 5- and 6-bit
    types where that is smaller (not Q5_0 / Q5_1 / Q6_K on the integer-dot kernels, which hold their own 0.69 / 0.75 /
    0.875 bytes a weight)."""
    if _lean_int8(raw.ggml_type, raw.shape):
        return Int8Linear.from_raw(raw)
    return stored_kernel(raw, fixed_rows)


def lean_nbytes(ggml_type: str, shape: Sequence[int]) -> int:
    """The bytes lean_kernel holds for a matrix of this type and shape [N, K] (3-D: its rows), without building it."""
    if _lean_int8(ggml_type, shape):
        return _int8_rows_nbytes(math.prod(shape[:-1]), shape[-1])
    return stored_nbytes(ggml_type, shape)


def _int8_rows_nbytes(n: int, k: int) -> int:
    return n * k + n * 2  # int8 + a bf16 scale per row


def stored_nbytes(ggml_type: str, shape: Sequence[int]) -> int:
    """The bytes stored_kernel holds for a matrix of this type and shape [N, K] (3-D: its rows), without building it."""
    n, k = math.prod(shape[:-1]), shape[-1]
    if ggml_type in FLOAT_TYPES:
        return n * k * dense_dtype().itemsize
    if qdot_takes(ggml_type):
        return -(-n // qdot.GROUP_ROWS) * qdot.GROUP_ROWS * qdot.row_bytes(QDOT_TYPES[ggml_type], k)
    if ggml_type in INT4_TYPES + INT4_PAIR_TYPES and int4_fits((n, k)):
        planes = 1 if ggml_type in INT4_TYPES else 2
        return planes * (n * k // 2 + n * (k // GROUP) * 2 * 2)  # nibbles + a bf16 scale and zero per group
    return _int8_rows_nbytes(n, k)


def auto_nbytes(ggml_type: str, shape: Sequence[int], prefill_dtype: torch.dtype) -> int:
    """The bytes make_linear's auto holds for a matrix of this type and shape with a prefill copy in prefill_dtype."""
    n, k = math.prod(shape[:-1]), shape[-1]
    if qdot_takes(ggml_type):  # no dense copy (make_linear)
        return stored_nbytes(ggml_type, (n, k))
    if _quantized_kernel_takes(ggml_type, (n, k)):
        return stored_nbytes(ggml_type, (n, k)) + n * k * prefill_dtype.itemsize
    return n * k * dense_dtype().itemsize


def _quantized_kernel_takes(ggml_type: str, shape: Sequence[int]) -> bool:
    """auto runs this matrix on its stored blocks (the integer-dot or int4 kernels) below the crossover."""
    return qdot_takes(ggml_type) or (ggml_type in INT4_TYPES + INT4_PAIR_TYPES and int4_fits(shape))


def _rows_of(raws: list[RawTensor]) -> RawTensor:
    """Tensors of one type and width as one, their rows (output features) concatenated in order."""
    if len(raws) == 1:
        return raws[0]
    n, k = sum(r.shape[0] for r in raws), raws[0].shape[1]
    return RawTensor("+".join(r.name for r in raws), raws[0].ggml_type, (n, k), torch.cat([r.data for r in raws]))


def make_linear(raws: list[RawTensor], mode: str, device: torch.device | str = "cpu",
                batch_invariant: bool = False, prefill_dtype: torch.dtype | None = None) -> Linear:
    """One linear for the row-concatenation of `raws` (q|k|v, gate|up, or a single matrix; any mix of types), in
    `mode` (each run of same-typed parts on one kernel, a ConcatLinear where the kernels differ):

    - f32, bf16: one dense matrix;
    - lean: each type's lean_kernel (memory about the file's);
    - auto: the fastest kernels, memory permitting (the caller runs lean when the budget says no): 4- and 8-bit
      types decode as int4 (one plane or two), which the compiled decode step covers; every other type runs the
      dense kernel (dense_dtype()) at every size, as fast as int8 rows eagerly; and a dense copy of the whole
      matrix (prefill_dtype, bf16 or float32, prepacked; None: dense_dtype()) takes micro-batches from the
      crossover on wherever int4 runs below it. Where the integer-dot kernels take every part (qdot_takes), they run
      every size and no dense copy is kept: on an AVX2 CPU they outrun the prepacked float32 kernel at every size
      (docs/models.md#what-each-type-runs-as---weights).

    batch_invariant: a row's result must not depend on how many rows a call has: auto never switches kernels
    (lean; the quantized kernels' per-row results were checked equal for any M), dense kernels run on fixed blocks
    of INVARIANT_ROWS rows."""
    if mode not in WEIGHT_MODES:
        raise GgufError(f"unknown weights mode {mode!r}; choose one of {', '.join(WEIGHT_MODES)}")
    rows = INVARIANT_ROWS if batch_invariant else None
    if mode in ("f32", "bf16") or torch.device(device).type != "cpu":
        dtype = torch.float32 if mode == "f32" else torch.bfloat16
        return DenseLinear(torch.cat([dequantize(r) for r in raws]).to(device), dtype, rows, prepack_f32=mode != "f32")
    # lean, the invariant mode, and auto where the integer-dot kernels take every part: each run of one type (and one
    # int4 fit: q may fit where k and v do not; the integer-dot kernels take any rows) on its stored kernel
    if mode == "lean" or batch_invariant or all(qdot_takes(r.ggml_type) for r in raws):
        kernel = lean_kernel if mode == "lean" else stored_kernel
        parts = [kernel(_rows_of(list(run)), rows) for _, run in
                 itertools.groupby(raws, lambda r: (r.ggml_type, qdot_takes(r.ggml_type) or int4_fits(r.shape)))]
        return parts[0] if len(parts) == 1 else ConcatLinear(parts)

    def int4_run(r: RawTensor) -> str:  # a run's key: its type where int4 or qdot takes it, else "dense" (runs merge)
        return r.ggml_type if _quantized_kernel_takes(r.ggml_type, r.shape) else "dense"

    parts = [stored_kernel(_rows_of(run)) if key != "dense" else
             DenseLinear(torch.cat([dequantize(r) for r in run]), dense_dtype(), prepack_f32=True)
             for key, run in ((k, list(g)) for k, g in itertools.groupby(raws, int4_run))]
    if all(isinstance(p, DenseLinear) for p in parts):
        return parts[0]
    small = parts[0] if len(parts) == 1 else ConcatLinear(parts)
    large = DenseLinear(torch.cat([dequantize(r) for r in raws]), prefill_dtype or dense_dtype(), prepack_f32=True)
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
