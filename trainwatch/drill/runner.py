"""Run one drill: ``trainwatch run`` on a fresh run directory with the drill's fault and
settings, watched until it ends or times out, every process it started stopped by pid.

What the drill saw that the run directory does not keep (the agent's findings, the exit
code, a timeout) goes into ``RUN_DIR/drill/drill.json``, next to the settings files, so
the drill can be scored again later (``trainwatch drill score``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from trainwatch.drill.agent_findings import FindingsWatcher
from trainwatch.drill.record import RECORD_FORMAT, RECORD_VERSION, record_file
from trainwatch.drill.settings import DrillSettings, write_files
from trainwatch.contract.env import FAULT_ENV, LAUNCH_ENV, SUPERVISOR_ENV
from trainwatch.process.proctree import marked, stop, wait_gone
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.process.stopsignals import stopping

STOP_GRACE_SECONDS = 60.0  # `trainwatch run` stops its job gracefully first (SIGTERM, save)


def fresh_run_dir(out: Path, name: str) -> RunDir:
    """A new, empty run directory for one drill under ``out`` (never reuses one)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path, n = out / f"{name}-{stamp}", 1
    while path.exists():
        n += 1
        path = out / f"{name}-{stamp}-{n}"
    path.mkdir(parents=True)
    return RunDir(path)


def command(settings: DrillSettings, run: RunDir, files: dict[str, Path]) -> list[str]:
    return [sys.executable, "-m", "trainwatch", "run",
            "--nproc-per-node", str(settings.nproc_per_node), "--run-dir", str(run.root),
            "--config", str(files["train"]), "--thresholds", str(files["thresholds"]),
            "--agent-config", str(files["agent"]),
            "--max-restarts", str(settings.drill.max_restarts), "--no-live"]


def stop_tree(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """Stop ``trainwatch run`` and everything under it.

    SIGINT first: it stops its job (SIGTERM, the ranks checkpoint) and its agent. Whatever
    is left after ``grace`` is SIGKILLed by pid; the tree is listed before, because torchrun
    starts ranks in sessions of their own, out of reach of a process-group signal, and a
    killed parent leaves its children to init.
    """
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    token = _token(tree)
    stop(proc, signal.SIGINT, grace)
    # and what it started during the grace (a restart's ranks), and any it left to init on
    # the way (a rank whose torchrun is gone: it still carries the supervisor's mark)
    tree = _with_children(tree + (marked(SUPERVISOR_ENV, token) if token else []))
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    wait_gone(tree, timeout=5)


def _token(procs: list[psutil.Process]) -> str | None:
    """The supervisor's mark its children carry in their environment (runlock.py)."""
    for p in procs:
        try:
            token = p.environ().get(SUPERVISOR_ENV)
        except psutil.Error:
            continue
        if token:
            return token
    return None


def _with_children(procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and every descendant of those still alive, each once."""
    found = {p.pid: p for p in procs}
    for p in procs:
        try:
            for child in p.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def snapshot(run: RunDir, started: float, watcher: FindingsWatcher) -> dict[str, Any]:
    """What the progress display shows: time, step, and the story so far."""
    steps = [step for s in run.statuses().records if isinstance(step := s.get("step"), int)]
    events = run.events("fault_injected", "alert_firing", "action_taken", "job_started",
                        "checkpoint_resumed", "finished")
    return {"elapsed": time.time() - started, "step": max(steps) if steps else None,
            "faults": [e for e in events if e["event"] == "fault_injected"],
            "alerts": sorted({str(e.get("alert")) for e in events
                              if e["event"] == "alert_firing"}),
            "actions": [str(e.get("action")) for e in events if e["event"] == "action_taken"],
            "findings": sorted({f["kind"] for f in watcher.findings()}),
            "resumed": any(e["event"] == "checkpoint_resumed" for e in events),
            "finished": any(e["event"] == "finished" for e in events)}


def run_drill(settings: DrillSettings, run: RunDir, *, timeout: float,
              on_progress: Callable[[dict[str, Any]], None] | None = None,
              poll_seconds: float = 0.5) -> dict[str, Any]:
    """Run the drill to its end (or ``timeout``); returns the record it wrote."""
    run.create()
    files = write_files(settings, run.drill_dir)
    cmd = command(settings, run, files)
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, LAUNCH_ENV)}
    env.update({FAULT_ENV: settings.drill.fault_env(), "PYTHONUNBUFFERED": "1"})
    started = time.time()
    record: dict[str, Any] = {
        "format": RECORD_FORMAT, "version": RECORD_VERSION, "drill": settings.drill.name,
        "fault": settings.drill.fault, "settings": settings.to_json(), "command": cmd,
        "started_at": started, "ended_at": None, "timeout_seconds": timeout,
        "exit_code": None, "timed_out": False, "interrupted": False, "findings": [],
        "agent_polls_failed": 0}
    atomic_write_json(record_file(run), record)
    with open(run.drill_log, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    watcher = FindingsWatcher(run)
    fault = None
    if settings.drill.supervisor_fault:  # the drill itself acts on `trainwatch run`
        from trainwatch.drill.supervisor import SupervisorFault
        fault = SupervisorFault(settings.drill, run, cmd, env, run.drill_log)
    try:
        while proc.poll() is None:
            if time.time() - started > timeout:
                record["timed_out"] = True
                stop_tree(proc)
                break
            watcher.poll()
            if fault is not None:
                proc = fault.check(proc)
            if on_progress is not None:
                on_progress(snapshot(run, started, watcher))
            time.sleep(poll_seconds)
    except KeyboardInterrupt:
        stopping()
        record["interrupted"] = True
        stop_tree(proc)
        raise
    finally:
        if proc.poll() is None:  # an error in the loop itself: leave nothing running
            stop_tree(proc)
        if fault is not None:
            fault.stop_left()
        record.update({"ended_at": time.time(), "exit_code": proc.returncode,
                       "findings": watcher.findings(), "agent_polls_failed": watcher.errors})
        atomic_write_json(record_file(run), record)
    return record
