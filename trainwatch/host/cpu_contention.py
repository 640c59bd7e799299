"""How contended a node's CPUs are, read from /proc (``proc_root`` lets tests give fixture
files): runnable tasks against cores, the kernel's CPU pressure, steal time, and how long a
thread waited for a CPU (``schedstat``).

These are evidence that does not share the failure: a job slowed by CPU contention reports
only that it is slow; the kernel's run queue and pressure say why.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _text(proc_root: str, *parts: str) -> str | None:
    try:
        return Path(proc_root, *parts).read_text(errors="replace")
    except OSError:
        return None


def node_sample(proc_root: str = "/proc") -> dict[str, Any]:
    """One reading: ``cores`` (cpuN lines of /proc/stat), ``runnable`` (tasks running or
    waiting for a CPU now: /proc/stat's procs_running), ``load1``, ``pressure_some_avg10``
    (% of the last 10 s some task waited for a CPU; None without PSI) and the ``steal`` and
    ``total`` ticks of all CPUs (a rate needs two readings: ``steal_share``)."""
    out: dict[str, Any] = {"cores": None, "runnable": None, "load1": None,
                           "pressure_some_avg10": None, "steal": None, "total": None}
    stat = _text(proc_root, "stat") or ""
    cores = 0
    for line in stat.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "cpu" and len(fields) > 8:
            ticks = [int(x) for x in fields[1:] if x.isdigit()]
            # guest time is already counted in user: the first eight fields are the total
            out["total"], out["steal"] = sum(ticks[:8]), ticks[7]
        elif fields[0].startswith("cpu") and fields[0][3:].isdigit():
            cores += 1
        elif fields[0] == "procs_running" and len(fields) > 1 and fields[1].isdigit():
            out["runnable"] = int(fields[1])
    out["cores"] = cores or os.cpu_count()
    load = (_text(proc_root, "loadavg") or "").split()
    if load:
        try:
            out["load1"] = float(load[0])
        except ValueError:
            pass
    for line in (_text(proc_root, "pressure", "cpu") or "").splitlines():
        if line.startswith("some "):
            values = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
            try:
                out["pressure_some_avg10"] = float(values["avg10"])
            except (KeyError, ValueError):
                pass
    return out


def steal_share(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """The share (0..1) of CPU time the hypervisor stole between two readings."""
    if None in (before.get("total"), after.get("total"), before.get("steal"),
                after.get("steal")):
        return None
    total = after["total"] - before["total"]
    return (after["steal"] - before["steal"]) / total if total > 0 else None


def run_delay_ns(pid: int, proc_root: str = "/proc") -> int | None:
    """Nanoseconds a process's main thread has waited, runnable, for a CPU (the second
    field of its ``schedstat``); None when unknown."""
    fields = (_text(proc_root, str(pid), "task", str(pid), "schedstat") or "").split()
    try:
        return int(fields[1])
    except (ValueError, IndexError):
        return None
