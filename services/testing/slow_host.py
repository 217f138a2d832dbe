"""Stage processes made into slower or smaller hosts on this one machine: each pinned to a core of its own
(taskset's sched_setaffinity, every thread) and throttled to a share of the CPU by a cgroup v1 cpu controller
(cpu.cfs_quota_us), from the moment it exists -- before it loads or measures anything (--split auto measures at
start). Needs a writable /sys/fs/cgroup/cpu (root) for the throttle."""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field

CGROUP = "/sys/fs/cgroup/cpu"
PERIOD_US = 100_000


def can_throttle() -> bool:
    return os.access(CGROUP, os.W_OK)


@contextlib.contextmanager
def throttled(pid: int, share: float):
    """The process `pid` (every thread) limited to `share` of the machine's cores while the block runs."""
    if not can_throttle():
        raise SystemExit(f"{CGROUP} is not writable: run where the cgroup v1 cpu controller is (as root)")
    path = os.path.join(CGROUP, f"stagemesh-slow-{pid}")
    os.makedirs(path, exist_ok=True)
    root_procs = os.path.join(CGROUP, "cgroup.procs")
    try:
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(PERIOD_US))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(int(share * (os.cpu_count() or 1) * PERIOD_US)))
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        yield
    finally:
        with contextlib.suppress(OSError), open(root_procs, "w") as f:
            f.write(str(pid))
        with contextlib.suppress(OSError):
            os.rmdir(path)


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` (and the threads they start later, which inherit it) on `cores` only."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(tid), cores)


@dataclass
class SlowStages:
    """start_up's while_starting: each stage index in `cores` pinned to that core, each in `quota` throttled to that
    share of ONE core, as soon as its process exists; `gateway_core` pins the `up` process (the gateway) too. Leave
    the block (stack) to lift the throttles."""

    stack: contextlib.ExitStack
    cores: dict[int, int] = field(default_factory=dict)
    quota: dict[int, float] = field(default_factory=dict)
    gateway_core: int | None = None
    done: dict[int, int] = field(default_factory=dict)  # stage index -> pid, once pinned and throttled

    def __call__(self, gw) -> None:
        if self.gateway_core is not None and not self.done:
            pin(gw.proc.pid, {self.gateway_core})
        for index, pid in gw.stage_pids().items():
            if index in self.done:
                continue
            if index in self.quota:
                self.stack.enter_context(throttled(pid, self.quota[index] / (os.cpu_count() or 1)))
            if index in self.cores:
                pin(pid, {self.cores[index]})
            self.done[index] = pid

    def repin(self) -> None:
        """Pin again every thread the stages started since (torch's own pool inherits; this makes sure)."""
        for index, pid in self.done.items():
            if index in self.cores:
                pin(pid, {self.cores[index]})


def start_pinned(stack: contextlib.ExitStack, quotas: list[float], streams: int, *flags: str,
                 gateway_core: int | None = None):
    """`stagemesh up` with one stage per entry of `quotas`, each pinned to a core of its own (--threads-alone 1, as
    on hosts of their own) and throttled to that share of it from its start (1.0: not at all), `--kv-slots streams`
    and `flags`; stopped, with the throttles lifted, when `stack` closes. Returns (the running gateway, SlowStages)."""
    from services.testing.harness import start_up

    logs = stack.enter_context(tempfile.TemporaryDirectory())
    slow = SlowStages(stack, cores={i: i % (os.cpu_count() or 1) for i in range(len(quotas))},
                      quota={i: q for i, q in enumerate(quotas) if q < 1.0}, gateway_core=gateway_core)
    gw = start_up(len(quotas), None, logs, *flags, "--threads-alone", "1", "--kv-slots", str(streams),
                  while_starting=slow)
    stack.callback(gw.stop)
    slow.repin()
    return gw, slow
