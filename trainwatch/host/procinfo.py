"""Facts about a rank's OS process (psutil) and the CPU load on its cores (/proc/stat).

A status file names the rank's pid; the pid is trusted only if that process was
created before the rank's telemetry started (a reused pid is a different process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

# psutil status -> the names trainwatch uses (docs/agent.md)
_STATUS = {
    psutil.STATUS_RUNNING: "running", psutil.STATUS_SLEEPING: "sleeping",
    psutil.STATUS_IDLE: "sleeping", psutil.STATUS_DISK_SLEEP: "disk_sleep",
    psutil.STATUS_STOPPED: "stopped", psutil.STATUS_TRACING_STOP: "stopped",
    psutil.STATUS_ZOMBIE: "zombie", psutil.STATUS_DEAD: "gone",
}
# Filtered environment the NCCL and network collectors need; values never leave the agent.
ENV_PREFIXES = ("NCCL_", "TORCH_", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")


def read_cpu_jiffies(proc_root: str) -> dict[int, tuple[float, float]]:
    """Per-CPU (busy, total) seconds from /proc/stat."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, tuple[float, float]] = {}
    try:
        lines = Path(proc_root, "stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        parts = line.split()
        try:
            cpu = int(parts[0][3:])
            values = [int(v) for v in parts[1:]]
        except ValueError:
            continue
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        total = sum(values[:8])  # guest time is already in user/nice
        out[cpu] = ((total - idle) / ticks, total / ticks)
    return out


@dataclass
class _Tracked:
    process: psutil.Process
    cpu_seconds: float | None = None
    env: dict[str, str] = field(default_factory=dict)


class ProcessTracker:
    """Keeps psutil handles per pid so CPU deltas and env reads are cheap across runs."""

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root
        self._tracked: dict[int, _Tracked] = {}
        self._cpu_prev: dict[int, tuple[float, float]] = {}
        self._cpu_now: dict[int, tuple[float, float]] = {}
        self._own_prev: dict[int, tuple[float, float]] = {}

    def begin(self) -> None:
        """Call once per collection before ``inspect``: samples per-CPU load."""
        self._cpu_prev, self._cpu_now = self._cpu_now, read_cpu_jiffies(self.proc_root)

    def end(self, live_pids: set[int]) -> None:
        for pid in list(self._tracked):
            if pid not in live_pids:
                del self._tracked[pid]
                self._own_prev.pop(pid, None)

    def inspect(self, pid: Any, started_at: Any) -> dict[str, Any]:
        """Process facts for one rank; ``status`` is ``gone`` or ``unknown`` when not found."""
        if not isinstance(pid, int) or pid <= 0:
            return {"status": "unknown"}
        tracked = self._tracked.get(pid)
        try:
            if tracked is None:
                proc = psutil.Process(pid)
                if isinstance(started_at, (int, float)) and proc.create_time() > started_at + 2:
                    return {"status": "gone"}  # pid reused by a younger process
                tracked = self._tracked[pid] = _Tracked(proc, env=_filtered_env(proc))
            proc = tracked.process
            with proc.oneshot():
                status = _STATUS.get(proc.status(), "unknown")
                times = proc.cpu_times()
                cpu = times.user + times.system
                info: dict[str, Any] = {"status": status, "cpu_seconds": cpu,
                                        "rss_bytes": proc.memory_info().rss,
                                        "threads": proc.num_threads()}
                try:
                    cpus = proc.cpu_affinity()
                except (psutil.Error, AttributeError, OSError):
                    cpus = []
            info["cpus"] = cpus
            info["cpu_contention_ratio"] = self._contention(pid, cpu, cpus)
            return info
        except psutil.NoSuchProcess:
            self._tracked.pop(pid, None)
            return {"status": "gone"}
        except psutil.ZombieProcess:
            return {"status": "zombie"}
        except psutil.AccessDenied:
            return {"status": "unknown"}

    def env(self, pid: Any) -> dict[str, str]:
        tracked = self._tracked.get(pid) if isinstance(pid, int) else None
        return dict(tracked.env) if tracked else {}

    def _contention(self, pid: int, cpu_seconds: float, cpus: list[int]) -> float | None:
        """Share of the rank's allowed cores' time used by *other* processes since last time."""
        prev = self._own_prev.get(pid)
        self._own_prev[pid] = (cpu_seconds, 0.0)
        if prev is None or not cpus or not self._cpu_prev:
            return None
        busy = total = 0.0
        for cpu in cpus:
            if cpu in self._cpu_now and cpu in self._cpu_prev:
                busy += self._cpu_now[cpu][0] - self._cpu_prev[cpu][0]
                total += self._cpu_now[cpu][1] - self._cpu_prev[cpu][1]
        if total <= 0:
            return None
        others = busy - (cpu_seconds - prev[0])
        return min(1.0, max(0.0, others / total))


def _filtered_env(proc: psutil.Process) -> dict[str, str]:
    try:
        env = proc.environ()
    except (psutil.Error, OSError):
        return {}
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES)}
