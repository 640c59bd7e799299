"""Process state of each rank on this host (psutil): alive, zombie, stopped, D state, and
what each of its threads waits in (the kernel's view, trainwatch/host/procinfo.py)."""

from __future__ import annotations

import socket
import time
from typing import Any

import psutil

from trainwatch.diagnose.model import Evidence
from trainwatch.host.procinfo import main_thread_runnable_ns, reused, thread_waits
from trainwatch.node import node_name

# psutil status -> the words docs/agent.md uses.
CPU_SAMPLE_MIN_S = 0.5  # shortest interval a CPU share is measured over
_STATUS = {psutil.STATUS_DISK_SLEEP: "disk_sleep", psutil.STATUS_STOPPED: "stopped",
           psutil.STATUS_TRACING_STOP: "stopped", psutil.STATUS_ZOMBIE: "zombie",
           psutil.STATUS_DEAD: "gone"}


def local_names() -> set[str]:
    """The names a rank on this host may give as its node: the hostname, or the node name
    the job was given ($TRAINWATCH_NODE, as ranks, agents and supervisors use it)."""
    names = {socket.gethostname(), socket.getfqdn(), "localhost", node_name()}
    return {n for n in names if n}


def gather(ev: Evidence) -> None:
    here = local_names()
    remote = set()
    for view in ev.ranks.values():
        if view.get("node") not in here or not isinstance(view.get("pid"), int):
            view["process"] = {"status": "unknown", "visible": False}
            remote.add(view.get("node") or "?")
            continue
        view["process"] = inspect(view["pid"], view.get("started_at"),
                                  view.get("process_created_at"))
    if remote:
        ev.cannot_see(f"processes on node(s) {sorted(remote)} (not this host, {ev.host}); "
                      "run diagnose there or pass their --agent URL")


def inspect(pid: int, started_at: float | None,
            created_at: float | None = None) -> dict[str, Any]:
    """State of one rank process; a reused pid (another process than the rank's) counts as
    gone."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if reused(proc.create_time(), started_at, created_at):
                return {"status": "gone", "visible": True, "note": "pid reused by another process"}
            status = _STATUS.get(proc.status(), proc.status())
            info: dict[str, Any] = {"status": status, "visible": True,
                                    "cpu_seconds": round(sum(proc.cpu_times()[:2]), 2),
                                    "cpu_sampled_at": time.monotonic(),
                                    "main_thread_runnable_ns": main_thread_runnable_ns(pid),
                                    "rss_bytes": proc.memory_info().rss,
                                    "threads": proc.num_threads()}
    except psutil.NoSuchProcess:
        return {"status": "gone", "visible": True}
    except psutil.AccessDenied:
        return {"status": "unknown", "visible": True, "note": "no permission to inspect"}
    waits = thread_waits(pid)
    info["thread_waits"] = waits
    blocked = [{"tid": t["tid"], "wchan": t["wchan"] or "?"} for t in waits if t["state"] == "D"]
    if blocked:
        info["threads_in_disk_sleep"] = blocked
    return info


def sample_cpu(ev: Evidence) -> None:
    """Each live local rank's CPU use since ``gather``: ``cpu_percent`` (of one core, the
    whole process) and ``main_runnable_percent`` (its main thread on a CPU or waiting for
    one, which a loaded machine does not lower). A main thread runnable all the time with a
    silent heartbeat is busy (in C, holding the GIL), not frozen."""
    views = [v for v in ev.ranks.values() if (v.get("process") or {}).get("cpu_sampled_at")
             and v["process"]["status"] not in ("gone", "zombie")]
    if not views:
        return
    first = min(v["process"]["cpu_sampled_at"] for v in views)
    time.sleep(max(0.0, CPU_SAMPLE_MIN_S - (time.monotonic() - first)))
    for view in views:
        info = view["process"]
        try:
            cpu = sum(psutil.Process(view["pid"]).cpu_times()[:2])
        except psutil.Error:
            continue
        elapsed = time.monotonic() - info.pop("cpu_sampled_at")
        info["cpu_percent"] = round(100.0 * max(0.0, cpu - info["cpu_seconds"]) / elapsed, 1)
        info["cpu_seconds"] = round(cpu, 2)
        before, after = info.pop("main_thread_runnable_ns", None), main_thread_runnable_ns(view["pid"])
        if before is not None and after is not None:
            info["main_runnable_percent"] = round(min(100.0, (after - before) / elapsed / 1e7),
                                                  1)
