"""Where tensors live and in which dtype. One place decides the defaults."""

from __future__ import annotations

import functools

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX); without it bf16 is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype_name(device: torch.device | None = None) -> str:
    device = device or default_device()
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def resolve_dtype(name: str | None, device: torch.device | None = None) -> torch.dtype:
    name = name or default_dtype_name(device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]
