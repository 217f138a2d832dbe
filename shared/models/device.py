"""Where tensors live and in which dtype. One place decides the defaults."""

from __future__ import annotations

import functools

import torch

from shared.config import DTYPE_NAMES
from shared.cpu import cpu_flags

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """The one answer to "is bf16 fast on this CPU?": the CPU multiplies bf16 natively (AVX512-BF16 or AMX) and
    oneDNN has a bf16 GEMM for it. Without both, bf16 is emulated and slower than float32. It picks the default
    dtype, the dense kernel (shared.models.linear.dense_dtype) and whether a bf16 matrix is oneDNN-prepacked."""
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    return native and torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_kv_dtype(name: str | None, activations: torch.dtype) -> torch.dtype:
    """--kv-dtype: a dtype by name; auto: float16 where the activations are float32 -- half the bytes of each cached
    position, llama.cpp's default cache type (f16), read by attention widened to float32 -- else the activations' own
    dtype (already half precision); None (not given): the activations' dtype."""
    if name is None:
        return activations
    if name == "auto":
        return torch.float16 if activations == torch.float32 else activations
    if name not in DTYPES:
        raise ValueError(f"unknown K/V dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype_name(device: torch.device | None = None) -> str:
    """The activations' dtype when none is asked for (the K/V cache's: resolve_kv_dtype). On a CPU: float32 where the integer-dot kernels
    run (they take float32 activations and return float32, as the decode-attention kernel and the batched compiled
    decode step do: a bf16 model pays two casts a matrix and runs its steps eagerly; float32 decoded faster at 1 and
    16 sequences even on a CPU with native bf16, docs/performance.md#model-sizes), else bf16 where the CPU multiplies
    it natively, else float32."""
    device = device or default_device()
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    # the kernels' own module says whether they run here (built and measured once per machine)
    from shared.kernels.qdot import usable as integer_dot_kernels_run

    return "bfloat16" if cpu_has_fast_bf16() and not integer_dot_kernels_run() else "float32"


def resolve_dtype(name: str | None, device: torch.device | None = None) -> torch.dtype:
    name = name or default_dtype_name(device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]
