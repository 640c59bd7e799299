"""Host checks: /dev/shm, file and locked-memory limits, free memory, leftover trainers.

Limits are those of the preflight process itself (``resource``): run preflight the way
the job's ranks are started (same user, container and launcher) for them to mean
something - a Slurm prolog running as root has root's limits, not the job's.
"""

from __future__ import annotations

import os
import re
import resource
import time
from pathlib import Path
from typing import Any

import psutil

from trainwatch.host.timeouts import Deadline, Hung
from trainwatch.preflight.model import Check
from trainwatch.units import human_bytes

SHM_TIMEOUT = 5.0  # seconds; /dev/shm is memory, so a slow answer means a sick kernel
# psutil status -> what the evidence says, and how bad a leftover in it is.
_LEFTOVER_STATUS = {psutil.STATUS_ZOMBIE: ("zombie", "fail"),
                    psutil.STATUS_DISK_SLEEP: ("disk_sleep (D)", "fail"),
                    psutil.STATUS_STOPPED: ("stopped", "fail"),
                    psutil.STATUS_TRACING_STOP: ("stopped", "fail")}


def check_host(cfg: dict[str, Any], sys_root: str, deadline: Deadline | None = None
               ) -> list[Check]:
    rdma = _rdma_devices(sys_root)
    return [check_shm(cfg, deadline or Deadline()), check_nofile(cfg), check_memlock(rdma),
            check_memory(cfg), check_leftovers(cfg)]


def _rdma_devices(sys_root: str) -> list[str]:
    try:
        return sorted(p.name for p in Path(sys_root, "class", "infiniband").iterdir())
    except OSError:
        return []


def check_shm(cfg: dict[str, Any], deadline: Deadline) -> Check:
    path, need = cfg["shm_path"], int(cfg["min_shm_bytes"])
    try:
        vfs = deadline.call(f"shm:{path}", lambda: os.statvfs(path), SHM_TIMEOUT)
    except (Hung, OSError) as exc:
        return Check("host.shm", "fail", f"{path}: {getattr(exc, 'strerror', None) or exc}",
                     {"path": path})
    size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    evidence: dict[str, Any] = {"path": path, "size_bytes": size, "free_bytes": free,
                                "min_bytes": need}
    if size < need:
        return Check("host.shm", "fail", f"{path} is {human_bytes(size)}, need "
                     f"{human_bytes(need)} (container default 64 MiB? set --shm-size / "
                     "an emptyDir with medium: Memory)", evidence)
    if free < need:
        evidence["largest_entries"] = _largest(path)
        return Check("host.shm", "fail", f"{path}: only {human_bytes(free)} free of "
                     f"{human_bytes(size)} (files left by an earlier job?)", evidence)
    return Check("host.shm", "ok", f"{path}: {human_bytes(free)} free of {human_bytes(size)}",
                 evidence)


def _largest(path: str, limit: int = 5, scan: int = 10000) -> list[str]:
    """The biggest entries of a directory (bounded scan): who fills /dev/shm."""
    sizes = []
    try:
        with os.scandir(path) as entries:
            for i, entry in enumerate(entries):
                if i >= scan:
                    break
                try:
                    sizes.append((entry.stat(follow_symlinks=False).st_size, entry.name))
                except OSError:
                    continue
    except OSError:
        return []
    return [f"{name} {human_bytes(size)}" for size, name in sorted(sizes, reverse=True)[:limit]]


def _limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def check_nofile(cfg: dict[str, Any]) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    evidence = {"soft": _limit_text(soft), "hard": _limit_text(hard)}
    unlimited = soft == resource.RLIM_INFINITY
    hint = (f"; raise it with `ulimit -n {_limit_text(hard)}`" if hard != soft else
            "; raise nofile in limits.conf / the container runtime")
    if not unlimited and soft < cfg["fail_nofile_below"]:
        return Check("host.nofile", "fail", f"open files limit (ulimit -n) is {soft}, need "
                     f"{cfg['fail_nofile_below']}{hint}", evidence)
    if not unlimited and soft < cfg["warn_nofile_below"]:
        return Check("host.nofile", "warn", f"open files limit (ulimit -n) is {soft}, "
                     f"below {cfg['warn_nofile_below']} (many DataLoader workers run out)"
                     f"{hint}", evidence)
    return Check("host.nofile", "ok", f"open files limit (ulimit -n) is {_limit_text(soft)}",
                 evidence)


def check_memlock(rdma: list[str]) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    evidence = {"soft": _limit_text(soft), "hard": _limit_text(hard), "rdma_devices": rdma}
    if soft == resource.RLIM_INFINITY:
        return Check("host.memlock", "ok", "locked memory (ulimit -l) is unlimited", evidence)
    text = f"locked memory (ulimit -l) is {human_bytes(soft)}"
    if rdma:
        return Check("host.memlock", "fail", f"{text}; RDMA ({', '.join(rdma)}) needs "
                     "unlimited (NCCL over InfiniBand fails to register memory)", evidence)
    return Check("host.memlock", "ok", f"{text}; fine without RDMA devices (none here)",
                 evidence)


def check_memory(cfg: dict[str, Any]) -> Check:
    mem = psutil.virtual_memory()
    evidence = {"total_bytes": mem.total, "available_bytes": mem.available}
    text = f"{human_bytes(mem.available)} of {human_bytes(mem.total)} available"
    if mem.available < cfg["fail_available_memory_bytes"]:
        return Check("host.memory", "fail", f"only {text}", evidence)
    if mem.total and mem.available / mem.total < cfg["warn_available_memory_ratio"]:
        return Check("host.memory", "warn", f"only {text} (something else is running?)",
                     evidence)
    return Check("host.memory", "ok", text, evidence)


# A shell whose command line mentions torchrun is a wrapper, not a trainer: what it started
# is a process of its own, and is found as such.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "csh", "tcsh", "busybox"})


def find_trainers(patterns: list[str]) -> list[dict[str, Any]]:
    """Processes that look like training processes, other than this one and its parents
    (and shells that merely mention one)."""
    compiled = [re.compile(p) for p in patterns]
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status", "username",
                                     "create_time"], ad_value=None):
        info = proc.info
        if info["pid"] in mine:
            continue
        argv = info["cmdline"] or []
        cmdline = " ".join(argv)
        name = info["name"] or ""
        if name in SHELLS or (argv and os.path.basename(argv[0]) in SHELLS):
            continue
        if not any(p.search(cmdline) or p.search(name) for p in compiled):
            continue
        state, severity = _LEFTOVER_STATUS.get(info["status"],
                                               (info["status"] or "unknown", "warn"))
        found.append({"pid": info["pid"], "status": state, "severity": severity, "name": name,
                      "cmdline": cmdline[:200], "user": info["username"],
                      "age_seconds": round(time.time() - info["create_time"])
                      if info["create_time"] else None})
    return found


def check_leftovers(cfg: dict[str, Any]) -> Check:
    found = find_trainers(cfg["trainer_patterns"])
    evidence = {"processes": found}
    bad = [p for p in found if p["severity"] == "fail"]
    if bad:
        text = ", ".join(f"pid {p['pid']} {p['name']} {p['status']}" for p in bad[:3])
        return Check("host.leftovers", "fail", f"{len(bad)} training process(es) stuck from "
                     f"an earlier job: {text} (a zombie goes when its parent is killed; D state "
                     "usually needs a reboot)", evidence,
                     runbook="TrainingRankDown")
    if found:
        text = ", ".join(f"pid {p['pid']} {p['name']}" for p in found[:3])
        return Check("host.leftovers", "warn", f"{len(found)} training process(es) already "
                     f"running: {text} (an earlier job?)", evidence)
    return Check("host.leftovers", "ok", "no training processes running", evidence)
