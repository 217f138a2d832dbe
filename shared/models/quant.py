"""GGUF blocks unpacked to their numbers (torch, vectorised): each quantized type's levels, scales and offsets exactly
as the file stores them, and `dequantize`, the float32 weights llama.cpp dequantizes to. What a kernel then does with
the numbers is shared.models.linear's; tests/test_quant.py holds every type here to gguf's own dequantizers."""

from __future__ import annotations

import numpy as np
import torch

from shared.files.gguf_loader import RawTensor

GROUP = 32  # ggml's block of 4-bit types (Q4_K: a 256-superblock of 8 such groups)
# The types whose every group of 32 is, exactly, w = q * scale + low (unpack_levels).
GROUP_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K")
FLOAT_TYPES = ("F32", "F16", "BF16")  # plain numbers
# Bytes per block and elements per block of the types unpacked here with torch (the rest go through gguf.quants).
BLOCKS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256), "Q8_0": (34, 32), "Q5_0": (22, 32),
          "Q5_1": (24, 32), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> [...] float32 (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15 in ggml order: low nibbles are elements 0..15, high ones 16..31."""
    out = torch.empty(*qs.shape[:-1], 32, dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=out[..., :16])
    torch.bitwise_right_shift(qs, 4, out=out[..., 16:])
    return out


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[..., count/8] bytes -> [..., count] bits 0/1, little-endian (bit i of byte j is element 8j + i)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b[..., :, None] >> shifts) & 1).reshape(*b.shape[:-1], count)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks -> scales, mins [..., 8] float32."""
    sc = b.to(torch.int32)
    lo4, hi4, mix = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = torch.cat([lo4 & 0x3F, (mix & 0x0F) | ((lo4 >> 2) & 0x30)], dim=-1).float()
    mins = torch.cat([hi4 & 0x3F, (mix >> 4) | ((hi4 >> 2) & 0x30)], dim=-1).float()
    return scales, mins


def unpack_levels(raw: RawTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q8_0 -> (q [N, K] uint8 levels, scale [N, K/32] f32, low [N, K/32]
    f32) with, exactly, w = q * scale + low (Q4_0: d*(q-8) -> scale d, low -8d; Q4_1: d*q + m; Q4_K: d*sc*q -
    dmin*mn; Q5_0: d*(q-16); Q5_1: d*q + m; Q5_K: d*sc*q - dmin*mn; Q8_0: d*i8 -> levels i8 + 128 in 0..255, scale
    d, low -128d). A 3-D tensor comes back as its rows, [E * N, K]."""
    n, k = raw.data.shape[0], raw.shape[-1]
    size, per = BLOCKS[raw.ggml_type]
    b = raw.data.reshape(n, k // per, size)
    if raw.ggml_type == "Q8_0":
        d = _f16(b[..., 0:2])
        q = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return q.reshape(n, k), d, -128.0 * d
    if raw.ggml_type in ("Q5_0", "Q5_1"):  # [d, (m,) qh: 4 bytes of fifth bits, 16 bytes of nibbles]
        d, at = _f16(b[..., 0:2]), 2
        low = -16.0 * d
        if raw.ggml_type == "Q5_1":
            low, at = _f16(b[..., 2:4]), 4
        q = _nibbles(b[..., at + 4:]) | (_bits(b[..., at:at + 4], 32) << 4)
        return q.reshape(n, k), d, low
    if raw.ggml_type == "Q5_K":  # d, dmin, 12 bytes of scales, 32 bytes of fifth bits (bit j: sub-block j), 128 of nibbles
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        scales, mins = _k_scales(b[..., 4:16])
        high = _bits(b[..., 16:48], 256).view(n, k // per, 32, 8).transpose(-1, -2)  # [N, K/256, 8 sub-blocks, 32]
        qs = b[..., 48:].reshape(n, k // per, 4, 32)
        low4 = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, k // per, 8, 32)
        q = (low4 | (high << 4)).reshape(n, k)
        return q, (d[..., None] * scales).reshape(n, -1), (-(dmin[..., None] * mins)).reshape(n, -1)
    if raw.ggml_type == "Q4_0":
        d = _f16(b[..., 0:2])
        return _nibbles(b[..., 2:]).reshape(n, k), d, -8.0 * d
    if raw.ggml_type == "Q4_1":
        return _nibbles(b[..., 4:]).reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4])
    # Q4_K: d, dmin fp16; 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks; 128 bytes of nibbles where byte
    # chunk j (32 bytes) holds sub-block 2j in its low nibbles and 2j+1 in its high ones.
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    scales, mins = _k_scales(b[..., 4:16])  # [N, K/256, 8]
    qs = b[..., 16:].reshape(n, k // per, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, k)  # [N, K/256, 4, 2, 32] -> sub-block order
    return q, (d[..., None] * scales).reshape(n, -1), (-(dmin[..., None] * mins)).reshape(n, -1)


def q6_k_levels(raw: RawTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K -> (q [N, K] int8 levels -32..31, scale [N, K/16] float32) with, exactly, w = q * scale (d * sc of each
    sub-block of 16). A 210-byte superblock of 256: ql[128] (low nibbles), qh[64] (2 high bits each), sc[16] int8, d
    fp16. Its halves of 128 hold 4 runs of 32: run g's element l has ql[32 (g % 2) + l]'s low nibble (g < 2) or high
    one, and bits 2g, 2g+1 of qh[l] (ggml's dequantize_row_q6_K)."""
    n, k = raw.data.shape[0], raw.shape[-1]
    size, per = BLOCKS["Q6_K"]
    b = raw.data.reshape(n, k // per, size)
    ql = b[..., 0:128].reshape(n, k // per, 2, 2, 32)  # [.., half, g % 2, l]
    qh = b[..., 128:192].reshape(n, k // per, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3)  # runs g = 0..3
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, k)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [N, K/256, 16]
    return q, (_f16(b[..., 208:210])[..., None] * sc).reshape(n, k // 16)

def k_low_levels(raw: RawTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q2_K / Q3_K -> (q [N, K] uint8 levels, scales [N, K/16] int32, d [N, K/256] float32, dmin [N, K/256] or None)
    with, exactly, Q2_K: w = d sc q - dmin m (q 0..3; scales holds sc | m << 4, the file's bytes), Q3_K:
    w = d sc (q - 4) (q 0..7: the 2 low bits, plus 4 where the hmask bit is set; sc the 6-bit scale less 32).
    Q2_K (84 bytes): scales[16], qs[64], d, dmin; Q3_K (110): hmask[32], qs[64], scales[12] (6 bits each), d. In
    both, element 128h + 32j + 16s + l has its low bits at bits 2j of qs[32h + 16s + l] and sub-block (its scale) 8h
    + 2j + s = element // 16; Q3_K's third bit is bit 4h + j of hmask[16s + l] (ggml's dequantize_row_q*_K)."""
    n, k = raw.shape
    per = 256
    size = 84 if raw.ggml_type == "Q2_K" else 110
    b = raw.data.reshape(n, k // per, size)
    qs_at = 16 if raw.ggml_type == "Q2_K" else 32
    qs = b[..., qs_at:qs_at + 64].reshape(n, k // per, 2, 1, 32)  # [.., h, ., 16s + l]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    q = (qs >> shifts) & 3  # [.., h, j, 16s + l]: element 128h + 32j + 16s + l
    if raw.ggml_type == "Q2_K":
        return (q.reshape(n, k), b[..., 0:16].reshape(n, -1).to(torch.int32), _f16(b[..., 80:82]), _f16(b[..., 82:84]))
    hm = b[..., 0:32].reshape(n, k // per, 1, 1, 32)
    third = (hm >> torch.arange(8, dtype=torch.uint8).view(2, 4, 1)) & 1  # [.., h, j, 16s + l]
    q = (q | (third << 2)).reshape(n, k)
    a = b[..., 96:108].to(torch.int32)
    lo4, mid4, top = a[..., 0:4], a[..., 4:8], a[..., 8:12]
    six = torch.cat([(lo4 & 0x0F) | ((top & 3) << 4), (mid4 & 0x0F) | (((top >> 2) & 3) << 4),
                     (lo4 >> 4) | (((top >> 4) & 3) << 4), (mid4 >> 4) | (((top >> 6) & 3) << 4)], dim=-1)
    return q, (six - 32).reshape(n, -1), _f16(b[..., 108:110]), None


def apply_groups(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """q [N, K] levels, scale / low [N, K/32] -> w = q * scale + low, float32 [N, K] (exact: 8 x 17 bits)."""
    n = q.shape[0]
    return torch.addcmul(low[..., None], q.view(n, -1, GROUP), scale[..., None]).view(n, -1)


def dequantize(raw: RawTensor) -> torch.Tensor:
    """The GGUF's own numbers as float32 in raw.shape (exactly what llama.cpp dequantizes to)."""
    if raw.ggml_type in GROUP_TYPES:
        return apply_groups(*unpack_levels(raw)).view(raw.shape)
    if raw.ggml_type in FLOAT_TYPES:
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[raw.ggml_type]
        return raw.data.contiguous().view(dt).float().view(raw.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as np_dequantize

    values = np_dequantize(raw.data.numpy(), GGMLQuantizationType[raw.ggml_type])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(raw.shape)
