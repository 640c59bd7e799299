"""Was a dead rank killed by the OOM killer? Its memory cgroup and the kernel log say.

For each rank that is gone or that the launcher saw killed by SIGKILL: the memory cgroup
its status recorded (limit, OOM kills counted there) and the kernel log's OOM-kill line
for its pid. What cannot be read (the cgroup removed, the kernel log restricted) is
listed under "could not see".
"""

from __future__ import annotations

import signal

from trainwatch.diagnose.model import Evidence
from trainwatch.host.cgroup import kernel_oom_kills, memory_facts


def gather(ev: Evidence) -> None:
    killed = {x["pid"] for x in ev.launcher.get("failed", []) + ev.launcher.get("failures", [])
              + [ev.launcher.get("root_cause") or {}] if x.get("exitcode") == -signal.SIGKILL}
    dead = [v for v in ev.ranks.values() if v.get("pid") in killed
            or (v.get("process") or {}).get("status") in ("gone", "zombie")]
    if not dead:
        return
    kernel = kernel_oom_kills()
    if kernel.get("error"):
        ev.cannot_see(f"kernel log (OOM kills): {kernel['error']}")
    for view in dead:
        facts = memory_facts(view["cgroup"]) if view.get("cgroup") else {}
        if view.get("cgroup") and facts.get("dir") is None:
            ev.cannot_see(f"rank {view['rank']}: its memory cgroup {view['cgroup']} is gone")
        line = (kernel.get("kills") or {}).get(view.get("pid"))
        view["oom"] = {**facts, "kernel": line, "kernel_error": kernel.get("error")}
