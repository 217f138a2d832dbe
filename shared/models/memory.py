"""A stage's memory budget, and what it decides: whether weights mode auto keeps a dense prefill copy of its matrices.

In lean form a piece holds each matrix about as the file stores it (shared.models.linear: int4, two int4 planes,
int8 rows). auto holds dense copies for speed -- of every 4-bit matrix for prefill-sized micro-batches, and of every
other quantized matrix instead of its lean kernel (2 or 4 bytes a weight: 3-7x the file) -- which is the difference
between fitting and not for the users a pipeline exists for. So auto is kept only where the piece fits with it:

    auto's weights + KV cache <= budget   (its prefill copy in the measured prefill dtype, else bf16; else lean)

The budget is per stage (--memory-budget); by default DEFAULT_FRACTION of the memory available when the piece loads
(within the container's memory limit, where there is one), divided by the stages `up` starts on the host, after each
stage process's own runtime (stage_shares). Within it: the weights, the cached prefixes' K/V (their bound,
--prefix-cache-memory), and the live sequences' K/V (the rest: KVCache.live_bytes, by which the gateway admits).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import DoesNotFit

if TYPE_CHECKING:
    import torch

DEFAULT_FRACTION = 0.8  # of MemAvailable at load, for all the stages of one host together
PREFIX_FRACTION = 0.25  # of MemAvailable at load: a stage's cached prefixes by default (--prefix-cache-memory)
# A stage process's memory beyond its weights and KV: the interpreter, torch and its kernel library, ZeroMQ, the
# HTTP probe server, allocator slack. The allowance is set above what benchmarks.memory measures beyond the weights
# with eager decode (benchmarks/results/2026-11-28-sizes-memory-llama3.2-1b; docs/performance.md#model-sizes), so
# that it leaves room for the compiled decode graphs.
STAGE_RUNTIME_BYTES = int(0.4 * 2**30)
def cgroup_memory_files() -> list[tuple[str, str]]:
    """(limit, usage) files of this process's memory cgroup and of each cgroup above it, innermost first: v2, then v1.
    In a container /proc/meminfo shows the host's memory, while the cgroup's limit (a Kubernetes pod's
    resources.limits.memory) is what the OOM killer enforces; a process put in a cgroup by hand (no cgroup namespace)
    finds its own under /proc/self/cgroup's path, not at the mount's root."""
    own = {"v2": "/", "v1": "/"}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    own["v2"] = path
                elif "memory" in controllers.split(","):
                    own["v1"] = path
    except (OSError, ValueError):
        pass
    files = []
    for key, root, limit, usage in (("v2", "/sys/fs/cgroup", "memory.max", "memory.current"),
                                    ("v1", "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")):
        path = own[key]
        while True:
            d = os.path.normpath(root + "/" + path)
            files.append((os.path.join(d, limit), os.path.join(d, usage)))
            if path in ("/", ""):
                break
            path = os.path.dirname(path)
    return files


def cgroup_room() -> int | None:
    """Bytes this process's memory cgroups (its own and those above it) let it take beyond their working sets now
    (usage less the inactive file cache, which the kernel reclaims before it would kill: the kubelet's measure), the
    least of them; None where none sets a limit."""
    rooms = []
    for limit_file, usage_file in cgroup_memory_files():
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v2's and v1's "no limit"
            continue
        rooms.append(max(0, int(limit) - usage + _inactive_file(os.path.dirname(usage_file))))
    return min(rooms) if rooms else None


def _inactive_file(cgroup_dir: str) -> int:
    """The cgroup's inactive file cache (memory.stat: v2 inactive_file, v1 total_inactive_file), 0 where unreadable."""
    try:
        with open(os.path.join(cgroup_dir, "memory.stat")) as f:
            stat = dict(line.split() for line in f if line.count(" ") == 1)
    except (OSError, ValueError):
        return 0
    return int(stat.get("inactive_file", stat.get("total_inactive_file", 0)))


def available_bytes() -> int:
    """Memory available to a new allocation now: MemAvailable (free + reclaimable cache), or free pages, and no more
    than the memory cgroup's limit leaves (cgroup_room)."""
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if host is None:
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = cgroup_room()
    return host if room is None else min(host, room)


def return_freed_memory() -> None:
    """Give the heap's freed pages back to the OS (glibc's malloc_trim). Loading frees the copies it built weights
    from, matrix by matrix; below malloc's mmap threshold those come from the heap, which keeps them (a 1B-class
    piece's resident set stayed over a gigabyte above its weights; benchmarks.memory measures a stage's memory
    against its weights, docs/performance.md#model-sizes). Nothing where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def room() -> tuple[int, str]:
    """available_bytes() and what sets it, in words for an error message."""
    room_in_cgroup, host = cgroup_room(), available_bytes()
    if room_in_cgroup is not None and room_in_cgroup <= host:
        return room_in_cgroup, "what its memory cgroup's limit leaves"
    return host, "what the host has available"


def check_fits(what: str, need: int) -> None:
    """Refuse (DoesNotFit, naming `what`) before loading weights of `need` bytes that this process cannot hold: the
    OOM killer would stop it part way, minutes in, with no word of why."""
    have, source = room()
    if need > have:
        raise DoesNotFit(f"{what} need {need / 2**30:.2f} GiB for their weights even with --weights lean, and this "
                         f"process can have {have / 2**30:.2f} GiB ({source}); serve the model over more stages or "
                         "hosts (`stagemesh plan` shows a split that fits) or give this process more memory")


def default_budget(stages_on_host: int = 1) -> int:
    return int(available_bytes() * DEFAULT_FRACTION / max(1, stages_on_host))


def stage_shares(stages_on_host: int) -> tuple[int, int]:
    """(memory budget, cached-prefix bound) of each of the stages `up` is about to start on this host: the memory
    available now less each stage process's own runtime (STAGE_RUNTIME_BYTES, not taken yet), shared among them;
    DEFAULT_FRACTION of it for weights and K/V, PREFIX_FRACTION of it (within those) for cached prefixes. Together
    the stages commit no more than the host has, whatever the traffic."""
    n = max(1, stages_on_host)
    room = max(0, available_bytes() - n * STAGE_RUNTIME_BYTES)
    return max(1, int(room * DEFAULT_FRACTION / n)), max(1, int(room * PREFIX_FRACTION / n))


def default_prefix_bytes(rows_bytes: int) -> int:
    """--prefix-cache-memory's default: PREFIX_FRACTION of the memory available now, at most rows_bytes (what the
    prefix rows hold when every position is written)."""
    return max(1, min(rows_bytes, int(available_bytes() * PREFIX_FRACTION)))


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class PrefillCopy:
    """What the budget decided for auto's dense prefill copy: its dtype (None: no copy, the piece runs lean) and why."""

    dtype: torch.dtype | None
    reason: str


def plan_prefill_copy(budget: int, lean_bytes: int, kv_bytes: int, auto_bytes: Callable[[torch.dtype], int],
                      fastest: torch.dtype) -> PrefillCopy:
    """lean_bytes: the piece's weights in lean form; auto_bytes(dtype): in auto form with a prefill copy in dtype;
    fastest: the prefill kernel measured fastest here. Tries fastest, then bf16 (half of f32's bytes), then gives
    the copy up (lean)."""
    import torch  # here, not at the top: `up` reads this module's budgets before anything loads torch

    for dtype in dict.fromkeys((fastest, torch.bfloat16)):
        need = auto_bytes(dtype) + kv_bytes
        if need <= budget:
            return PrefillCopy(dtype, f"auto's dense copies ({str(dtype).removeprefix('torch.')} prefill) fit the "
                                      f"budget of {mib(budget)}: {mib(need - kv_bytes)} of weights (lean: "
                                      f"{mib(lean_bytes)}) and {mib(kv_bytes)} of KV cache")
    return PrefillCopy(None, f"no dense copies (lean): auto's weights take {mib(auto_bytes(torch.bfloat16))} even with "
                             f"a bf16 prefill copy, and the budget of {mib(budget)} holds "
                             f"{mib(max(0, budget - kv_bytes))} beside {mib(kv_bytes)} of KV cache (lean weights: "
                             f"{mib(lean_bytes)}; raise --memory-budget, or lower --kv-slots / --max-seq-len, to "
                             "prefill faster)")


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
