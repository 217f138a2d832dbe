"""This machine's kernel plans: choices timed once per machine and shape at a load, kept in a plans file
(~/.cache/stagemesh/kernel-plans.json, or $STAGEMESH_KERNEL_PLANS; "off" measures at every load) so that the same
file loads with the same kernels from run to run. shared.models.crossover (auto's prefill kernel and int4 crossover)
and shared.kernels.qdot (integer-dot or int4 on an AVX512 CPU) keep theirs here."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import platform
import tempfile
from collections.abc import Callable

import torch


@contextlib.contextmanager
def timing_alone():
    """Hold the machine-wide lock of load-time kernel timings: the stages of a mesh load at once, and two stages
    timing kernels on the same cores measure each other and pick a crossover the kernels timed alone would not).
    Other loading work still runs meanwhile."""
    with open(os.path.join(tempfile.gettempdir(), "stagemesh-kernel-timing.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


PLANS_ENV = "STAGEMESH_KERNEL_PLANS"  # the plans file; "off": measure at every load


def plans_path() -> str | None:
    value = os.environ.get(PLANS_ENV)
    if value == "off":
        return None
    return value or os.path.join(os.path.expanduser("~"), ".cache", "stagemesh", "kernel-plans.json")


@functools.cache
def machine_id() -> str:
    """What the timings depend on besides the shapes: the CPU, torch's version and the thread count."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return f"{cpu} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def _read_plans(path: str | None) -> dict:
    try:
        with open(path) as f:
            plans = json.load(f)
        return plans if isinstance(plans, dict) else {}
    except (OSError, TypeError, ValueError):  # none yet, unreadable or not JSON: measure (and rewrite it)
        return {}


def kernel_plan(key: str, measure: Callable[[], str | int], valid: Callable[[object], bool],
                per_thread_count: bool = True) -> tuple[str | int, bool]:
    """This machine's plan for `key` (a kernel choice for one shape): from the plans file where `valid` accepts it,
    else measure() timed alone and recorded there. Returns (value, whether it came from the file).
    per_thread_count=False: one plan whatever this process's thread count (a choice every process must share)."""
    machine = machine_id() if per_thread_count else machine_id().rsplit(" | ", 1)[0]
    path, full = plans_path(), f"{machine} | {key}"
    with timing_alone():
        plans = _read_plans(path)
        if valid(plans.get(full)):
            return plans[full], True
        value = measure()
        if path:
            plans[full] = value
            with contextlib.suppress(OSError):  # a read-only home: measured again next time, nothing worse
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(plans, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
    return value, False
