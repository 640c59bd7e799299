"""Run one corpus case: the corpus job under ``trainwatch run -- torchrun`` on a fresh run
directory, the case's fault injected, ``trainwatch diagnose --json`` asked again and again
from the fault on until it answers right (or the time is up), everything stopped by pid.

What it saw goes into ``RUN_DIR/drill/corpus.json`` (the record ``score.py`` reads): the
fault's time, every alert and agent finding, every diagnose answer with its start and end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from trainwatch.drill.agent_findings import FindingsWatcher
from trainwatch.drill.corpus import launch, score
from trainwatch.drill.corpus.case import CASE_ENV, WORKDIR_ENV, Case
from trainwatch.drill.nodes import NoFindings
from trainwatch.drill.runner import fresh_run_dir
from trainwatch.drill.settings import AGENT, THRESHOLDS
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.rundir.run_dir import RunDir

RECORD = "corpus.json"
STALL_AFTER = 3.0        # diagnose --stall-after: the drills' agent stall floor (settings.py)
START_WITHIN = 120.0     # seconds for the job to reach its fault step
CLEAN_SECONDS = 30.0     # how long a clean run is watched past its "fault" step
CLEAN_PAUSE = 2.0        # between two diagnose runs of a clean run


def record_path(run: RunDir) -> Path:
    return run.drill_dir / RECORD


def diagnose(run: RunDir, timeout: float) -> dict[str, Any]:
    """One ``trainwatch diagnose --json``: its answer, when it started and ended."""
    started = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", "--run-dir",
                               str(run.root), "--json", "--stall-after", str(STALL_AFTER)],
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired:
        code, out, err = None, "", f"diagnose did not answer within {timeout:g} s"
    answer: dict[str, Any] = {"started": started, "ended": time.time(), "exit_code": code,
                              "findings": []}
    try:
        report = json.loads(out)
        answer["findings"] = [score.brief(f) for f in report.get("findings") or []]
        answer["verdict"] = report.get("verdict")
    except ValueError:
        answer["error"] = (err or out).strip()[-500:]
    return answer


def _write_settings(run: RunDir) -> dict[str, Path]:
    run.drill_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, content in (("thresholds", THRESHOLDS), ("agent", AGENT)):
        files[name] = run.drill_dir / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(content, sort_keys=False))
    return files


def _fault_time(run: RunDir, case: Case) -> float | None:
    if case.expect is None:  # a clean run: the moment its ranks pass the fault step
        steps = [s.get("step") for s in run.statuses().records]
        done = len(steps) == case.world_size and all(isinstance(s, int) and s >= case.fault_step
                                                for s in steps)
        return time.time() if done else None
    faults = run.events("fault_injected")
    return faults[0]["time"] if faults else None


def run_case(case: Case, out: Path, *, diagnose_within: float, diagnose_timeout: float,
             on_progress: Callable[[str], None] | None = None) -> tuple[RunDir, dict[str, Any]]:
    """Run ``case`` once under ``out``; its run directory and record."""
    run = fresh_run_dir(out, case.kind)
    run.create()
    files = _write_settings(run)
    work = work_of(run)
    work.mkdir()
    scratch = Path(tempfile.mkdtemp(prefix="tw-"))  # DataLoader sockets: short paths
    record: dict[str, Any] = {"format": "trainwatch.drill.corpus.record", "version": 1,
                              "case": case.to_json(), "started_at": time.time(),
                              "fault_at": None, "answers": [], "alerts": [],
                              "agent_findings": [], "exit_code": None, "error": None}
    say = on_progress or (lambda text: None)
    procs: list[subprocess.Popen] = []
    try:
        env = {**os.environ, CASE_ENV: case.kind, WORKDIR_ENV: str(work), "TMPDIR": str(scratch),
               "TORCH_FR_BUFFER_SIZE": "2000", "PYTHONUNBUFFERED": "1"}
        env.update(case.prepare(work) if case.prepare else {})
        with launch.started(case, run, files, env, work) as procs:
            record["nodes"] = launch.node_names(work)
            _watch(case, run, record, procs, diagnose_within, diagnose_timeout, say)
    except Exception as exc:  # the record says what broke; the corpus goes on
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        codes = [p.returncode for p in procs]
        record["exit_code"] = next((c for c in codes if c), codes[0] if codes else None)
        if case.cleanup:
            case.cleanup(work)
        shutil.rmtree(scratch, ignore_errors=True)
        record["ended_at"] = time.time()
        record["alerts"] = [{"alert": e.get("alert"), "at": e["time"],
                             "rank": (e.get("labels") or {}).get("rank")}
                            for e in run.events("alert_firing")]
        atomic_write_json(record_path(run), record)
    return run, record


def _watch(case: Case, run: RunDir, record: dict[str, Any], procs: list[subprocess.Popen],
           within: float, timeout: float, say: Callable[[str], None]) -> None:
    """Wait for the fault, then ask diagnose until it answers right or time is up. The
    agents of a multi-node case listen inside their namespaces: not polled from here."""
    watcher = FindingsWatcher(run) if case.nnodes == 1 else NoFindings()
    deadline = time.time() + START_WITHIN
    while record["fault_at"] is None:
        watcher.poll()
        record["fault_at"] = _fault_time(run, case)
        if record["fault_at"] is None and (time.time() > deadline
                                           or any(p.poll() is not None for p in procs)):
            record["error"] = f"the job never reached its fault step (see {run.drill_log})"
            return
        time.sleep(0.3)
    if case.at_fault:
        case.at_fault(work_of(run))
    say(f"{'past' if case.expect is None else 'fault injected at'} step "
        f"{case.fault_step}; asking diagnose")
    _diagnose_until_right(case, run, record, procs[0], watcher, within, timeout, say)
    watcher.poll()
    record["agent_findings"] = watcher.findings()


def work_of(run: RunDir) -> Path:
    """The folder the case's hooks share (``WORKDIR_ENV``)."""
    return run.drill_dir / "work"


def _diagnose_until_right(case: Case, run: RunDir, record: dict[str, Any], proc,
                          watcher: FindingsWatcher | NoFindings, within: float, timeout: float,
                          say: Callable[[str], None]) -> None:
    t0 = record["fault_at"]
    while True:
        watcher.poll()
        answer = diagnose(run, timeout)
        record["answers"].append(answer)
        top = answer["findings"][0]["title"] if answer["findings"] else answer.get("error")
        say(f"diagnose after {answer['ended'] - t0:.1f} s: {top}")
        if case.expect is None:
            if time.time() - t0 > CLEAN_SECONDS:
                return
            time.sleep(CLEAN_PAUSE)
            continue
        if score.right(case, answer, record.get("nodes"))["right"]:
            return
        if time.time() - t0 > within:
            return
        if case.ends_job and proc.poll() is None:
            time.sleep(0.5)
