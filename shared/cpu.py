"""The CPU's feature flags, read once: what the kernels (shared.kernels.qdot) and the dtype default (shared.models.device)
decide by."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel lists them (/proc/cpuinfo); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())
