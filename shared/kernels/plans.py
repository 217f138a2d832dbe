"""This machine's kernel plans: choices timed once per machine and shape at a load, kept in a plans file
(--kernel-plan FILE, else $STAGEMESH_KERNEL_PLANS, else ~/.cache/stagemesh/kernel-plans.json; "off" measures at every
load) so that the same file loads with the same kernels from run to run, and stages given one file pick the same. shared.models.crossover (auto's prefill kernel and int4 crossover)
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


PLANS_ENV = "STAGEMESH_KERNEL_PLANS"  # the plans file when no --kernel-plan is given; "off": measure at every load


def default_plans_path() -> str | None:
    """$STAGEMESH_KERNEL_PLANS ("off": None), else ~/.cache/stagemesh/kernel-plans.json."""
    value = os.environ.get(PLANS_ENV)
    if value == "off":
        return None
    return value or os.path.join(os.path.expanduser("~"), ".cache", "stagemesh", "kernel-plans.json")


@functools.cache
def machine_id() -> str:
    """What the timings depend on besides the shapes: the CPU, torch's version and the thread count."""
    import torch  # here: choosing a plans file (the CLI, before a command's checks) must not load torch

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


class KernelPlans:
    """The kernel plans a process loads with: a plans file (None: measure at every load), and what it did with it --
    plans read from the file, plans measured (and written to it, where it can be written). Made once at the
    composition root (`use`, from --kernel-plan); a stage's /info shows info()."""

    def __init__(self, path: str | None):
        self.path = path
        self.read = 0
        self.measured = 0
        self.written = True  # every measured plan reached the file (False: it could not be written)

    @classmethod
    def from_flag(cls, value: str | None) -> KernelPlans:
        """--kernel-plan's value: a file, "off", or None (the default file)."""
        return cls(None if value == "off" else value or default_plans_path())

    def info(self) -> dict:
        return {"file": self.path, "read": self.read, "measured": self.measured, "written": self.written}

    def plan(self, key: str, measure: Callable[[], str | int], valid: Callable[[object], bool],
             per_thread_count: bool = True) -> tuple[str | int, bool]:
        """This machine's plan for `key` (a kernel choice for one shape): from the file where `valid` accepts it,
        else measure() timed alone and recorded there. Returns (value, whether it came from the file).
        per_thread_count=False: one plan whatever this process's thread count (a choice every process must share)."""
        machine = machine_id() if per_thread_count else machine_id().rsplit(" | ", 1)[0]
        full = f"{machine} | {key}"
        with timing_alone():
            plans = _read_plans(self.path)
            if valid(plans.get(full)):
                self.read += 1
                return plans[full], True
            value = measure()
            self.measured += 1
            if self.path:
                plans[full] = value
                try:
                    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                    tmp = f"{self.path}.{os.getpid()}.tmp"
                    with open(tmp, "w") as f:
                        json.dump(plans, f, indent=1, sort_keys=True)
                    os.replace(tmp, self.path)
                except OSError:  # a read-only file system: measured again next time, nothing worse
                    self.written = False
        return value, False


_active: KernelPlans | None = None


def use(plans: KernelPlans) -> KernelPlans:
    """Make `plans` the ones every load of this process plans its kernels with (the composition root calls it)."""
    global _active
    _active = plans
    return plans


def active() -> KernelPlans:
    """The plans in use: use()'s, else the default file's as the environment names it now (a process that never
    chose: a test, a library user)."""
    return _active if _active is not None else KernelPlans.from_flag(None)


def kernel_plan(key: str, measure: Callable[[], str | int], valid: Callable[[object], bool],
                per_thread_count: bool = True) -> tuple[str | int, bool]:
    """active().plan(...)."""
    return active().plan(key, measure, valid, per_thread_count)
