"""Confirm a stall with evidence of our own before a stall action kills anything.

A TrainingStalled alert is one signal: the agent's reading of the status files. Those can
lie by omission (a full disk stops them, a paused agent reads them late), so before the
controller kills a job it looks for itself, for a few seconds, at what does not come from
the status files:

* the rank processes (state and CPU time, from /proc through psutil): a stopped (SIGSTOP),
  zombie or vanished rank confirms at once;
* each rank's step counter from its beat file (written in place, so it gets through on a
  full disk) and, when the job serves them (``telemetry.metrics_port``), from the ranks'
  own metrics servers over HTTP; a step that moves in its status file counts too (a
  reader that was late is wrong, a file that moves is not).

Any rank that completes a step meanwhile refutes the stall; so does a rank inside a phase
it declared a budget for (``Telemetry.declare_phase``) that is not spent yet. Otherwise the
stall is confirmed after the window: ``max(min_seconds, 2 x the slowest rank's last step
time)``, at most ``max_seconds``, and it ends as soon as the answer is known. Everything
seen is returned for the journal.

``busy_refutes`` is for acting early, before the page's ``for``: then a rank that keeps a
CPU busy (``BUSY_CORES`` of one or more, or its main thread runnable ``BUSY_MAIN_RUNNABLE``
of the time, as the agent judges it) refutes the stall too. It may be working outside
any declared phase (an evaluation on rank 0 of a trainer that marks no phases) or spinning;
the evidence cannot tell, so the early action leaves it to the page's own look. Ranks that
wait in a collective, a lock or I/O use next to no CPU.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil

from trainwatch.rundir.beat import read_beat
from trainwatch.contract.ports import LOOPBACK
from trainwatch.contract.stall import BUSY_CORES, BUSY_MAIN_RUNNABLE
from trainwatch.host.procinfo import main_thread_runnable_ns
from trainwatch.rundir.run_dir import RunDir

_STEPS_TOTAL = re.compile(rb'^trainwatch_rank_steps_total\{[^}]*\} ([0-9.e+]+)$', re.M)
_DONE = ("stopped", "zombie", "gone")


@dataclass
class Confirmation:
    confirmed: bool
    reason: str
    seconds: float
    evidence: dict[str, Any] = field(default_factory=dict)

    def journal(self) -> dict[str, Any]:
        return {"confirmed": self.confirmed, "reason": self.reason,
                "seconds": round(self.seconds, 3), **self.evidence}


def _process(pid: int) -> tuple[str, float | None]:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            status, cpu = p.status(), p.cpu_times()
    except psutil.NoSuchProcess:
        return "gone", None
    except psutil.AccessDenied:
        return "unknown", None
    name = {psutil.STATUS_STOPPED: "stopped", psutil.STATUS_TRACING_STOP: "stopped",
            psutil.STATUS_ZOMBIE: "zombie", psutil.STATUS_DEAD: "gone",
            psutil.STATUS_DISK_SLEEP: "disk_sleep", psutil.STATUS_RUNNING: "running"}.get(
                status, "sleeping")
    return name, cpu.user + cpu.system


def _served_steps(port: int, timeout: float = 0.5) -> float | None:
    """steps_total from a rank's own metrics server (127.0.0.1:port), or None."""
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=timeout) as r:
            body = r.read(1 << 20)
    except (OSError, ValueError):
        return None
    match = _STEPS_TOTAL.search(body)
    return float(match.group(1)) if match else None


def _metrics_port(run: RunDir) -> int | None:
    config = (run.run_info() or {}).get("config") or {}
    port = (config.get("telemetry") or {}).get("metrics_port") if isinstance(
        config, dict) and isinstance(config.get("telemetry"), dict) else None
    return port if isinstance(port, int) and not isinstance(port, bool) and port > 0 else None


class _Look:
    """One look at every rank: {rank: facts}."""

    def __init__(self, run: RunDir, ranks: dict[int, tuple[int, int]], port: int | None):
        self.at = time.monotonic()
        self.ranks: dict[int, dict[str, Any]] = {}
        statuses = {s["rank"]: s for s in run.statuses().records}
        for rank, (pid, local_rank) in sorted(ranks.items()):
            state, cpu = _process(pid)
            beat = read_beat(run.beat_file(rank), run.root)
            if beat is not None and beat.get("pid") != pid:
                beat = None
            facts: dict[str, Any] = {"pid": pid, "process": state, "cpu_seconds": cpu,
                                     "main_runnable_ns": main_thread_runnable_ns(pid)}
            status = statuses.get(rank) or {}
            if status.get("pid") == pid:  # progress there is progress, stale or not
                facts["status_step"] = status.get("step")
                facts["status_progress_at"] = status.get("last_progress_at")
            if beat is not None:
                facts.update({k: beat.get(k) for k in (
                    "steps_total", "step", "phase", "phase_since", "phase_budget",
                    "step_time_seconds", "heartbeat_at", "publish_failing_since")})
            if port is not None:
                facts["served_steps_total"] = _served_steps(port + local_rank)
            self.ranks[rank] = facts


def _advanced(first: dict[str, Any], now: dict[str, Any]) -> str | None:
    for key in ("steps_total", "served_steps_total", "status_step", "status_progress_at"):
        a, b = first.get(key), now.get(key)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > a:
            return f"{key.replace('_', ' ')} went from {a:g} to {b:g}"
    return None


def _busy(first: _Look, last: _Look) -> tuple[int, float] | None:
    """(rank, cores) of the rank that used the most CPU between two looks, if it was busy:
    ``BUSY_CORES`` of a core, or its main thread ran or waited to run ``BUSY_MAIN_RUNNABLE``
    of the time (a spinning rank on a loaded machine gets less CPU than it wants)."""
    elapsed = last.at - first.at
    if elapsed <= 0:
        return None
    busy = []
    for rank, facts in last.ranks.items():
        before = first.ranks[rank]
        a, b = before.get("cpu_seconds"), facts.get("cpu_seconds")
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
            continue
        cores = (b - a) / elapsed
        ra, rb = before.get("main_runnable_ns"), facts.get("main_runnable_ns")
        runnable = (rb - ra) / 1e9 / elapsed if isinstance(ra, int) and isinstance(rb, int) \
            else 0.0
        if cores >= BUSY_CORES or runnable >= BUSY_MAIN_RUNNABLE:
            busy.append((cores, rank))
    if not busy:
        return None
    cores, rank = max(busy)
    return rank, cores


def confirm_stall(run: RunDir, ranks: dict[int, tuple[int, int]], *, min_seconds: float = 2.0,
                  max_seconds: float = 30.0, poll: float = 0.25, busy_refutes: bool = False,
                  clock: Callable[[], float] = time.time) -> Confirmation:
    """Look at the job's ranks ({rank: (pid, local rank)}) for up to a window; see the
    module docstring."""
    started = time.monotonic()
    if not ranks:
        return Confirmation(False, "no rank process of this job found to look at", 0.0)
    port = _metrics_port(run)
    first = _Look(run, ranks, port)
    step_times = [f.get("step_time_seconds") for f in first.ranks.values()]
    slowest = max((t for t in step_times if isinstance(t, (int, float))), default=0.0)
    window = min(max_seconds, max(min_seconds, 2.0 * slowest))
    evidence: dict[str, Any] = {"window_seconds": round(window, 3), "metrics_port": port,
                                "first": first.ranks}
    last = first
    while True:
        for rank, facts in last.ranks.items():
            if facts["process"] in _DONE:
                evidence["last"] = last.ranks
                return Confirmation(True, f"rank {rank} (pid {facts['pid']}) is "
                                    f"{facts['process']}", time.monotonic() - started,
                                    evidence)
            moved = _advanced(first.ranks[rank], facts)
            if moved:
                evidence["last"] = last.ranks
                return Confirmation(False, f"rank {rank} is progressing: {moved} in "
                                    f"{last.at - first.at:.1f} s", time.monotonic() - started,
                                    evidence)
            budget, since = facts.get("phase_budget"), facts.get("phase_since")
            if isinstance(budget, (int, float)) and isinstance(since, (int, float)) \
                    and clock() - since < budget:
                evidence["last"] = last.ranks
                return Confirmation(False, f"rank {rank} is in phase {facts.get('phase')} "
                                    f"for {clock() - since:.0f} s of the {budget:.0f} s the "
                                    "job declared for it", time.monotonic() - started,
                                    evidence)
        if time.monotonic() - started >= window:
            break
        time.sleep(poll)
        last = _Look(run, ranks, port)
    evidence["last"] = last.ranks
    busy = _busy(first, last) if busy_refutes else None
    if busy is not None:
        return Confirmation(False, f"rank {busy[0]} kept {busy[1]:.0%} of a core busy for "
                            f"{last.at - first.at:.1f} s without a step: working outside a "
                            "declared phase, or spinning; left to the page's own look",
                            time.monotonic() - started, evidence)
    sources = ["process state and CPU time"]
    if any("steps_total" in f for f in first.ranks.values()):
        sources.append("beat files")
    if port is not None:
        sources.append("rank metrics servers")
    evidence["sources"] = sources
    return Confirmation(True, f"no rank completed a step in {window:.1f} s "
                        f"(looked at: {', '.join(sources)})", time.monotonic() - started,
                        evidence)
