"""shared.models.quant against the `gguf` package's own dequantizers (numpy, written by llama.cpp's authors): for every
type it unpacks, the weights its levels, scales and offsets make are gguf's, bit for bit, on seeded random blocks
(any bits are valid levels and scales; the fp16 super-scales are drawn at a weight's sizes, so none is inf or NaN)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from shared.files.gguf_loader import RawTensor
from shared.models import quant

ROWS, COLS = 8, 512  # two superblocks of 256 a row
# Where each type's fp16 scales sit in its block (the rest of the block's bytes are levels and sub-scales: any bits).
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}
K_LOW = ("Q2_K", "Q3_K")
UNPACKED = (*quant.GROUP_TYPES, "Q6_K", *K_LOW)


def random_blocks(qtype: str, seed: int) -> RawTensor:
    """A ROWS x COLS matrix of qtype: random block bytes, its fp16 scale fields set to values in [1e-3, 1.1e-2)."""
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (ROWS * COLS // block_elems, block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        scales = (rng.random(blocks.shape[0]) * 0.01 + 1e-3).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    data = torch.from_numpy(blocks.reshape(ROWS, -1).copy())
    return RawTensor("w", qtype, (ROWS, COLS), data)


def gguf_weights(raw: RawTensor) -> np.ndarray:
    ref = gguf_dequantize(raw.data.numpy(), GGMLQuantizationType[raw.ggml_type]).reshape(ROWS, COLS)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0  # a real matrix, not zeros or NaNs
    return ref.astype(np.float32)


def weights_from_levels(raw: RawTensor) -> torch.Tensor:
    """The float32 weights [ROWS, COLS] the unpacked numbers make, by each unpacker's own stated formula."""
    if raw.ggml_type in quant.GROUP_TYPES:  # w = q * scale + low per group of 32
        q, scale, low = quant.unpack_levels(raw)
        assert q.dtype == torch.uint8 and scale.shape == low.shape == (ROWS, COLS // quant.GROUP)
        return quant.apply_groups(q, scale, low)
    if raw.ggml_type == "Q6_K":  # w = q * scale per sub-block of 16
        q, scale = quant.q6_k_levels(raw)
        assert q.dtype == torch.int8 and -32 <= int(q.min()) and int(q.max()) <= 31
        return (q.float().view(ROWS, -1, 16) * scale[..., None]).view(ROWS, COLS)
    q, scales, d, dmin = quant.k_low_levels(raw)  # per sub-block of 16
    d16 = d.repeat_interleave(16, dim=1)[..., None]  # [ROWS, COLS / 16, 1]: the superblock's d for each sub-block
    levels = q.float().view(ROWS, -1, 16)
    if raw.ggml_type == "Q2_K":  # w = d sc q - dmin m, sc | m << 4
        assert int(q.max()) <= 3
        sc, m = (scales & 0x0F).float()[..., None], (scales >> 4).float()[..., None]
        w = (d16 * sc) * levels - dmin.repeat_interleave(16, dim=1)[..., None] * m
    else:  # Q3_K: w = d sc (q - 4)
        assert dmin is None and int(q.max()) <= 7
        w = (d16 * scales.float()[..., None]) * (levels - 4)
    return w.view(ROWS, COLS)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("qtype", UNPACKED)
def test_unpacked_levels_make_ggufs_weights_exactly(qtype, seed):
    raw = random_blocks(qtype, seed)
    ref = gguf_weights(raw)
    np.testing.assert_array_equal(weights_from_levels(raw).numpy(), ref)
    if qtype not in K_LOW:  # (dequantize hands Q2_K / Q3_K to gguf itself)
        np.testing.assert_array_equal(quant.dequantize(raw).numpy(), ref)


@pytest.mark.parametrize("ftype", quant.FLOAT_TYPES)
def test_float_types_are_the_files_numbers(ftype):
    values = np.random.default_rng(3).standard_normal((ROWS, COLS)).astype(np.float32)
    stored = torch.from_numpy(values).to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[ftype])
    raw = RawTensor("w", ftype, (ROWS, COLS), stored.view(torch.uint8).view(ROWS, -1))
    ref = gguf_dequantize(raw.data.numpy(), GGMLQuantizationType[ftype]).reshape(ROWS, COLS)
    np.testing.assert_array_equal(quant.dequantize(raw).numpy(), ref.astype(np.float32))
    np.testing.assert_array_equal(quant.dequantize(raw).numpy(), stored.float().numpy())


def test_every_torch_unpacked_type_is_checked():
    """A type added to quant's tables without a case here fails this, not silently goes untested."""
    assert set(quant.BLOCKS) | set(K_LOW) == set(UNPACKED) == set(FP16_FIELDS)
    for qtype, (size, per) in quant.BLOCKS.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[qtype]] == (per, size)
