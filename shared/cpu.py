"""The CPU's feature flags, read once: what the kernels (shared.kernels.qdot) and the dtype default (shared.models.device)
decide by; and the CPU limit this process's cgroup puts on it (what a live re-split prices a throttled stage by)."""

from __future__ import annotations

import functools
import os


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel lists them (/proc/cpuinfo); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


CGROUP_ROOT = "/sys/fs/cgroup"


def cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> float:
    """The CPU this process's cgroup may use, in cores (its CFS quota over its period: a Kubernetes CPU limit, a
    `docker run --cpus`); 0.0 where there is none or it cannot be read. Read afresh each call (a process can be moved
    to another group while it runs). cgroup v1: the cpu controller's cpu.cfs_quota_us / cpu.cfs_period_us; v2:
    cpu.max. Where the group's own directory is not visible (a container sees its group as the root), the root's."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return 0.0
    for _, controllers, path in lines:
        path = path.lstrip("/")
        if "cpu" in controllers.split(","):  # v1
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                for where in (os.path.join(root, mount, path), os.path.join(root, mount)):
                    quota = _read_number(os.path.join(where, "cpu.cfs_quota_us"))
                    period = _read_number(os.path.join(where, "cpu.cfs_period_us"))
                    if quota is not None and period:
                        return quota / period if quota > 0 else 0.0
        elif controllers == "":  # v2: "0::/path"
            for where in (os.path.join(root, path), root):
                try:
                    with open(os.path.join(where, "cpu.max")) as f:
                        quota, period = f.read().split()[:2]
                except (OSError, ValueError):
                    continue
                return 0.0 if quota == "max" else int(quota) / int(period)
    return 0.0


def _read_number(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a `taskset`, a container's cpuset, Kubernetes' static CPU
    manager), not every core of the machine, which os.cpu_count() counts -- torch threads past the usable cores spin
    against each other. At least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def busy_cores(threads: int, limit: float) -> float:
    """The cores a process can keep busy: its torch threads, capped by its cgroup's CPU limit (0: none)."""
    threads = float(max(1, threads))
    return min(threads, limit) if limit > 0 else threads
