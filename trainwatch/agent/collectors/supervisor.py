"""Supervisor: whether the run's supervisor (``trainwatch run``, ``alerts receive`` with a
job) is alive and not frozen, seen from outside it.

The embedded alert engine lives in the supervisor, so a frozen (SIGSTOP, ``T``) or dead
supervisor pages about nothing, itself included: its job runs unrepaired. This agent judges
it instead, from what does not share its failure: the holder its ``supervisor.lock`` names
(``rundir/runlock.py``), that process's state in /proc, and its heartbeat
(``rundir/supervisor_beat.py``). Only the agent on the supervisor's host judges it (another
host's process cannot be seen), and only a holder that writes a heartbeat (``trainwatch
train`` by hand holds the lock but has nothing to repair with: it is not watched). A
supervisor that stopped cleanly empties the lock record, and a run whose journal says it
was stopped or closed (the journal collector's ``supervisor_stopped``) is over: neither
exports anything. TrainwatchSupervisorDown pages on ``trainwatch_run_supervisor_up == 0``.

No verdict rests on one signal: frozen is the kernel's own stopped state (and the alert
waits ``supervisor_down_for``); a stale heartbeat is hung only while the process is not
on a CPU (blocked, deadlocked) over the last two looks. A process that spins (a C call
holding the GIL, a machine so loaded its beat thread waits) is ``busy``: up, with its
heartbeat's age shown, until the heartbeat is ``BUSY_STALE_SECONDS`` old.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psutil

from trainwatch.agent.registry import Collector, Result, register
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import Holder, recorded_holder
from trainwatch.rundir.supervisor_beat import beat_age, read_supervisor_beat

# A heartbeat this old from a process that still runs (not stopped) is a hung process: its
# beat thread writes every second, so only a process that runs no Python for this long (a
# thread holding the GIL, a D-state read of a dead mount) misses it.
STALE_SECONDS = 20.0
# A stale heartbeat while the process uses at least BUSY_CPU_SHARE of a core is a busy
# supervisor, not a hung one, until its heartbeat is this old: then it repairs nothing
# either, busy or not. A blocked or deadlocked process uses next to no CPU; a spinning one
# gets its share of the cores, which on a loaded node is small (2 cores at load 10: ~0.2),
# so the line is low.
BUSY_STALE_SECONDS = 120.0
BUSY_CPU_SHARE = 0.05
CPU_WINDOW_SECONDS = 0.5  # the shortest time between two looks that measures CPU use
UP, FROZEN, DEAD, HUNG, BUSY = "running", "frozen", "dead", "hung", "busy"
log = logging.getLogger(__name__)
_STOPPED = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}


def process_state(holder: Holder) -> tuple[str, str | None, float | None]:
    """``running``, ``frozen`` (stopped: SIGSTOP, a debugger) or ``dead`` (gone, a zombie,
    or another process with its pid), with the /proc state letter's name when known and
    the CPU seconds it has used (None when unknown)."""
    try:
        proc = psutil.Process(holder.pid)
        if abs(proc.create_time() - holder.started_at) >= 0.01:
            return DEAD, "pid reused", None
        with proc.oneshot():
            status = proc.status()
            times = proc.cpu_times()
    except psutil.Error:
        return DEAD, "gone", None
    if status == psutil.STATUS_ZOMBIE:
        return DEAD, status, None
    if status in _STOPPED:
        return FROZEN, status, None
    return UP, status, times.user + times.system


def stale_verdict(age: float, cpu_share: float | None, previous: str | None = None) -> str:
    """What a heartbeat over ``STALE_SECONDS`` old means of a process that is not stopped:
    ``hung`` when it used under ``BUSY_CPU_SHARE`` of a core since the last look (blocked,
    deadlocked), ``busy`` (up) while it spins. With no earlier look to compare with: the
    ``previous`` verdict on this stale heartbeat, else ``running`` (the next look judges:
    no verdict on one sample)."""
    if age > BUSY_STALE_SECONDS:
        return HUNG
    if cpu_share is None:
        return previous if previous in (HUNG, BUSY) else UP
    return BUSY if cpu_share >= BUSY_CPU_SHARE else HUNG


def judge(run: RunDir, node: str | None = None,
          cpu_before: tuple[int, float, float] | None = None,
          previous: str | None = None) -> dict[str, Any] | None:
    """What this host can tell of the run's supervisor, or None when there is none to
    watch here (no holder, another host's, or one that writes no heartbeat). A multi-node
    job has one supervisor per node (``supervisors/<node>.lock``): ``node``'s is this
    agent's to judge. ``cpu_before``: the last look's (pid, CPU seconds, monotonic time),
    which tells a busy supervisor from a hung one; the verdict's ``cpu`` is this look's.
    ``previous``: the last look's state."""
    holder, mine = recorded_holder(run), None
    if holder is None and node is not None:
        holder, mine = recorded_holder(run, node), node
    if holder is None or not holder.here():
        return None
    beat = read_supervisor_beat(run, mine)
    if beat is None or beat.get("token") != holder.token:
        return None
    age = beat_age(beat)
    state, proc_status, cpu_seconds = process_state(holder)
    now = time.monotonic()
    cpu = None if cpu_seconds is None else (holder.pid, cpu_seconds, now)
    if state == UP and age is not None and age > STALE_SECONDS:
        share = None
        if cpu is not None and cpu_before is not None and cpu_before[0] == holder.pid \
                and now - cpu_before[2] > CPU_WINDOW_SECONDS:
            share = (cpu[1] - cpu_before[1]) / (now - cpu_before[2])
        state = stale_verdict(age, share, previous)
    return {"state": state, "up": state in (UP, BUSY), "heartbeat_age_seconds": age,
            "process_status": proc_status, "pid": holder.pid, "role": holder.role,
            "holder": holder.describe(), "cpu": cpu}


@register("supervisor", interval=2.0, timeout=5.0, first_delay=1.0)
class SupervisorCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.states: dict[str, str] = {}
        self.cpu: dict[str, tuple[int, float, float]] = {}  # the last look's, per run

    def _say(self, key: str, verdict: dict[str, Any]) -> None:
        """Log each change: with ``trainwatch run`` alone (no Prometheus), this log and
        /status are what says its supervisor is down."""
        if self.states.get(key, UP) != verdict["state"]:
            if verdict["state"] == BUSY:
                log.warning("the supervisor of %s is busy: its heartbeat is %s s old while "
                            "it runs on a CPU (%s); down if it reaches %.0f s", key,
                            _age(verdict["heartbeat_age_seconds"]), verdict["holder"],
                            BUSY_STALE_SECONDS)
            elif verdict["up"]:
                log.warning("the supervisor of %s runs again: %s", key, verdict["holder"])
            else:
                log.warning("the supervisor of %s is %s (%s, heartbeat %s s old): its job "
                            "runs with no repair; runbook TrainwatchSupervisorDown", key,
                            verdict["state"], verdict["holder"],
                            _age(verdict["heartbeat_age_seconds"]))
        self.states[key] = verdict["state"]

    def collect(self) -> Result:
        result = Result()
        ranks = self.ctx.store.data("ranks") or {}
        jobs = {j["run_dir"]: j["job"] for j in ranks.get("jobs", [])}
        journal = self.ctx.store.data("journal") or {}
        seen: dict[str, Any] = {}
        for run in self.ctx.run_dirs():
            key = str(run.root)
            tail = journal.get(key)
            if isinstance(tail, dict) and tail.get("supervisor_stopped"):
                continue
            verdict = judge(run, self.ctx.node, self.cpu.get(key), self.states.get(key))
            if verdict is None:
                continue
            cpu, before = verdict.pop("cpu"), self.cpu.get(key)
            if cpu is not None and (before is None or before[0] != cpu[0]
                                    or cpu[2] - before[2] > CPU_WINDOW_SECONDS):
                self.cpu[key] = cpu  # a look too soon after the last keeps the older one
            job = str(jobs.get(key) or run.run_name())
            seen[key] = {"job": job, **verdict}
            self._say(key, verdict)
            labels = {"run": job, "node": self.ctx.node}
            result.add("trainwatch_run_supervisor_up", verdict["up"], **labels)
            result.add("trainwatch_run_supervisor_heartbeat_age_seconds",
                       verdict["heartbeat_age_seconds"], **labels)
        for key in set(self.states) - set(seen):
            del self.states[key]
        for key in set(self.cpu) - set(seen):
            del self.cpu[key]
        result.data = seen
        return result


def _age(age: float | None) -> str:
    return "?" if age is None else f"{age:.0f}"
