"""A stage's memory budget, and what it decides: whether weights mode auto keeps a dense prefill copy of its matrices.

In lean form a piece holds each matrix about as the file stores it (shared.models.linear: int4, two int4 planes,
int8 rows). auto adds a dense copy of every quantized matrix for prefill-sized micro-batches (2 or 4 bytes a
weight: 3-7x the file), which makes prefill faster but is the difference between fitting and not for the users a
pipeline exists for. So the copy is kept only where the whole piece fits the budget with it:

    lean weights + KV cache + copy <= budget   (the copy in the measured prefill dtype, else bf16, else none)

The budget is per stage (--memory-budget); by default DEFAULT_FRACTION of the memory available when the piece loads,
divided by the stages `up` starts on the host.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

DEFAULT_FRACTION = 0.8  # of MemAvailable at load, for all the stages of one host together
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def available_bytes() -> int:
    """Memory available to a new allocation now (MemAvailable: free + reclaimable cache), or free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_budget(stages_on_host: int = 1) -> int:
    return int(available_bytes() * DEFAULT_FRACTION / max(1, stages_on_host))


def parse_bytes(text: str) -> int:
    """'4G', '512M', '1.5GiB', '1000000' -> bytes (binary units); ValueError naming the form otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size; give a positive number of bytes with an optional unit, e.g. 4G or 512M")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class PrefillCopy:
    """What the budget decided for auto's dense prefill copy: its dtype (None: no copy, the piece runs lean) and why."""

    dtype: torch.dtype | None
    reason: str


def plan_prefill_copy(budget: int, lean_bytes: int, kv_bytes: int, copy_weights: int,
                      fastest: torch.dtype) -> PrefillCopy:
    """copy_weights: elements of the matrices that would get a copy; fastest: the prefill kernel measured fastest
    here. Tries fastest, then bf16 (half of f32's bytes), then gives the copy up."""
    base = lean_bytes + kv_bytes
    for dtype in dict.fromkeys((fastest, torch.bfloat16)):
        need = base + copy_weights * dtype.itemsize
        if need <= budget:
            return PrefillCopy(dtype, f"a {str(dtype).removeprefix('torch.')} prefill copy ({mib(need - base)}) fits "
                                      f"the budget of {mib(budget)} beside {mib(lean_bytes)} of lean weights and "
                                      f"{mib(kv_bytes)} of KV cache")
    return PrefillCopy(None, f"no dense prefill copy: even in bf16 it takes {mib(copy_weights * 2)}, and the budget of "
                             f"{mib(budget)} holds {mib(max(0, budget - base))} beside {mib(lean_bytes)} of lean weights "
                             f"and {mib(kv_bytes)} of KV cache (raise --memory-budget, or lower --kv-slots / "
                             "--max-seq-len, to prefill faster)")


@dataclass(frozen=True)
class PieceMemory:
    """What a loaded piece was given and holds, for /info and `inspect`."""

    budget: int  # bytes for weights + KV cache (--memory-budget)
    kv_bytes: int  # the KV cache the piece was loaded for
    file_bytes: int  # the GGUF bytes of the piece's tensors (its share of the file)
    prefill_copy: str  # what the budget decided for auto's dense prefill copy, and why

    def report(self, weight_bytes: int, mapped_bytes: int) -> dict:
        """weight_bytes: every weight representation held in memory; mapped_bytes: read from the file's map as
        touched (the embedding table), not counted in weight_bytes."""
        return {"budget_bytes": self.budget, "kv_bytes": self.kv_bytes, "file_bytes": self.file_bytes,
                "weight_bytes": weight_bytes, "mapped_bytes": mapped_bytes,
                "weights_per_file_byte": round(weight_bytes / max(1, self.file_bytes), 3),
                "prefill_copy": self.prefill_copy}
