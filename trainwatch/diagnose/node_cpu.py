"""Whether this node's CPUs are contended while the job runs here: the node's run queue and
CPU pressure, the processes outside the job that take the CPU, how long each local rank
waited for a CPU, and whether its steps slowed against its own earlier steps.

Two readings around diagnose's CPU sample (``begin`` before, ``finish`` after), so the
rates cover the same half second as the ranks' own CPU shares (processes.sample_cpu).
Fills ``Evidence.node_cpu``; the rule is rules/cpu_contention.py.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import psutil

from trainwatch.diagnose.model import Evidence
from trainwatch.errors import FormatError
from trainwatch.host.cpu_contention import node_sample, run_delay_ns, steal_share
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import parse_json, read_run_file_tail

MIN_INTERVAL = 0.5       # seconds between the two readings
TAIL_BYTES = 256 * 1024  # of a rank's metrics log: a few hundred steps
RECENT_STEPS = 5         # the steps "now" is the median of: 3 slow steps establish it
BASELINE_STEPS = 40      # the oldest steps of the tail: the rank's own earlier pace
TOP_CONSUMERS = 5
_STATE: dict[int, dict[str, Any]] = {}  # id(ev) -> the first reading (not evidence)


def _local_ranks(ev: Evidence) -> dict[int, int]:
    """rank -> pid of the live ranks diagnose can see on this host."""
    return {r: v["pid"] for r, v in ev.ranks.items()
            if (v.get("process") or {}).get("visible") and isinstance(v.get("pid"), int)
            and v["process"].get("status") not in ("gone", "zombie", "unknown")}


def _cpu_times() -> dict[int, tuple[float, str, int | None]]:
    out = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info.get("cpu_times")
        if times is None:
            continue
        try:
            sid = os.getsid(proc.pid)
        except OSError:
            sid = None
        out[proc.pid] = (times.user + times.system, str(proc.info.get("name")), sid)
    return out


def begin(run: RunDir, ev: Evidence) -> None:
    ranks = _local_ranks(ev)
    if not ranks:
        return
    _STATE[id(ev)] = {"at": time.monotonic(), "node": node_sample(), "procs": _cpu_times(),
                      "delay": {r: run_delay_ns(pid) for r, pid in ranks.items()}}
    ev.node_cpu = {"slowdown": {r: slowdown(run, r) for r in ranks}}


def finish(ev: Evidence) -> None:
    first = _STATE.pop(id(ev), None)
    if first is None:
        return
    time.sleep(max(0.0, MIN_INTERVAL - (time.monotonic() - first["at"])))
    elapsed = time.monotonic() - first["at"]
    node, procs = node_sample(), _cpu_times()
    ranks = _local_ranks(ev)
    job_sessions = {procs.get(pid, (0, "", None))[2] for pid in ranks.values()} - {None}
    mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    outside = []
    for pid, (cpu, name, sid) in procs.items():
        if pid in mine or sid in job_sessions or pid not in first["procs"]:
            continue
        share = 100.0 * max(0.0, cpu - first["procs"][pid][0]) / elapsed
        if share >= 1.0:
            outside.append({"pid": pid, "comm": name, "cpu_percent": round(share, 1)})
    outside.sort(key=lambda p: -p["cpu_percent"])
    waited = {}
    for rank, pid in ranks.items():
        before, after = first["delay"].get(rank), run_delay_ns(pid)
        if before is not None and after is not None:
            waited[rank] = round(min(1.0, (after - before) / 1e9 / elapsed), 3)
    ev.node_cpu.update({
        "cores": node["cores"], "runnable": node["runnable"], "load1": node["load1"],
        "pressure_some_avg10": node["pressure_some_avg10"],
        "steal_share": steal_share(first["node"], node), "seconds": round(elapsed, 2),
        "outside_cpu_percent": round(sum(p["cpu_percent"] for p in outside), 1),
        "top_outside": outside[:TOP_CONSUMERS], "rank_wait_share": waited})


def slowdown(run: RunDir, rank: int) -> dict[str, Any] | None:
    """A rank's median step time over its last steps against the median of the oldest
    steps its metrics log's tail holds (its own earlier pace); None with too few steps."""
    try:
        tail = read_run_file_tail(run.metrics_file(rank), run.root, max_bytes=TAIL_BYTES)
    except (OSError, FormatError):
        return None
    times = []
    for line in tail.splitlines():
        record, _ = parse_json(line)
        if isinstance(record, dict) and record.get("kind") == "step" \
                and isinstance(record.get("step_time_seconds"), (int, float)):
            times.append(float(record["step_time_seconds"]))
    if len(times) < RECENT_STEPS + BASELINE_STEPS // 2:
        return None
    recent = statistics.median(times[-RECENT_STEPS:])
    base = statistics.median(times[:-RECENT_STEPS][:BASELINE_STEPS])
    return {"recent": round(recent, 4), "baseline": round(base, 4),
            "ratio": round(recent / base, 2) if base > 0 else None}
