"""A process's memory cgroup, its limit and OOM kills, and the kernel's OOM-kill lines.

A rank killed by SIGKILL may have been killed by the OOM killer: its memory cgroup counts
the kills (v2 ``memory.events``: ``oom_kill``; v1 ``memory.oom_control``: ``oom_kill``) and
holds the limit (v2 ``memory.max``; v1 ``memory.limit_in_bytes``), and the kernel log names
the process it killed. A rank records its cgroup at start (the status's ``cgroup``), so the
facts can be read after it is gone. Reading the kernel log may need privileges
(``kernel.dmesg_restrict``): that is reported, never guessed around.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

CGROUP_ROOT = "/sys/fs/cgroup"
UNLIMITED = 1 << 62  # v1 reports "no limit" as a huge page-aligned number
_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\)")
_LIMIT = re.compile(r"\bmemory: usage \d+kB, limit (\d+)kB")
_MEMCG = re.compile(r"oom-kill:.*?\boom_memcg=([^,]*),task_memcg=([^,]*),task=[^,]*,pid=(\d+)")


def memory_cgroup(pid: int | str = "self", proc_root: str = "/proc") -> str | None:
    """``"v2:/path"`` or ``"v1:/path"``: the process's memory cgroup, None if unknown."""
    try:
        with open(f"{proc_root}/{pid}/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:  # v1 memory controller first: on hybrid hosts it holds the limit
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            return f"v1:{path}"
    for line in lines:
        if line.startswith("0::"):
            return f"v2:{line[3:]}"
    return None


def cgroup_dir(cgroup: str, root: str = CGROUP_ROOT) -> str | None:
    """The cgroup's folder under the cgroup file system, None when it is not there."""
    version, _, path = cgroup.partition(":")
    candidates = ([f"{root}/memory{path}"] if version == "v1" else
                  [f"{root}{path}", f"{root}/unified{path}"])
    return next((c.rstrip("/") for c in candidates if os.path.isdir(c)), None)


def memory_facts(cgroup: str, root: str = CGROUP_ROOT) -> dict[str, Any]:
    """``{"cgroup", "dir", "limit_bytes", "oom_kills"}`` (None where unreadable). The limit
    that binds is the smallest of the cgroup's and its ancestors' (a job's limit is often
    set on its slice, not on each rank's own cgroup); ``limit_cgroup`` is added when an
    ancestor sets it, naming that ancestor."""
    folder = cgroup_dir(cgroup, root)
    facts: dict[str, Any] = {"cgroup": cgroup.partition(":")[2], "dir": folder,
                             "limit_bytes": None, "oom_kills": None}
    if folder is None:
        return facts
    v1 = cgroup.startswith("v1:")
    version, _, path = cgroup.partition(":")
    while True:  # the cgroup itself, then each ancestor up to the root
        at = cgroup_dir(f"{version}:{path}", root)
        limit = _read(f"{at}/{'memory.limit_in_bytes' if v1 else 'memory.max'}") if at else None
        if limit and limit.strip().isdigit() and int(limit) < UNLIMITED and (
                facts["limit_bytes"] is None or int(limit) < facts["limit_bytes"]):
            facts["limit_bytes"] = int(limit)
            facts.pop("limit_cgroup", None)
            if at != folder:
                facts["limit_cgroup"] = path or "/"
        if path.rstrip("/") in ("", "/"):
            break
        path = path.rstrip("/").rsplit("/", 1)[0] or "/"
    events = _read(f"{folder}/{'memory.oom_control' if v1 else 'memory.events'}") or ""
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            facts["oom_kills"] = int(value)
    return facts


def kernel_oom_kills(timeout: float = 3.0) -> dict[str, Any]:
    """The kernel log's OOM kills: ``{"kills": {pid: {"process", "memcg", "line"}}}``, or
    ``{"error": why}`` when the log cannot be read (not root with dmesg_restrict=1)."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout,
                              errors="replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"dmesg: {exc}"}
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": f"{reason} (reading the kernel log needs privileges when "
                         "kernel.dmesg_restrict=1)"}
    return {"kills": parse_oom_kills(done.stdout)}


def parse_oom_kills(log: str) -> dict[int, dict[str, Any]]:
    """{pid: {"process", "line", "memcg", "oom_memcg", "limit_bytes"}} of a kernel log.

    A memory cgroup's OOM report prints the limit it hit (``memory: usage N kB, limit N kB``)
    before naming the cgroup whose limit that is (``oom_memcg``, the killed task's own or an
    ancestor) and the process killed: the limit that killed, readable after the cgroup is
    gone. A system-wide OOM prints no such line (no cgroup limit killed it)."""
    kills: dict[int, dict[str, Any]] = {}
    limit: int | None = None
    for line in log.splitlines():
        if "invoked oom-killer" in line:
            limit = None  # a new report: an earlier one's limit is not this one's
        hit = _LIMIT.search(line)
        if hit:
            limit = int(hit[1]) * 1024 if int(hit[1]) * 1024 < UNLIMITED else None
        memcg = _MEMCG.search(line)
        if memcg:
            kills.setdefault(int(memcg[3]), {}).update(
                memcg=memcg[2] or memcg[1], oom_memcg=memcg[1] or None, limit_bytes=limit)
        killed = _KILLED.search(line)
        if killed:
            entry = kills.setdefault(int(killed[1]), {})
            entry.update(process=killed[2], line=line.strip()[:300])
    return kills


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read(4096)
    except OSError:
        return None
