"""Score a drill from what it left: the journal, the agent findings it saw, torchrun's log
and ``trainwatch report``'s reading of the run (attempts, resume points, incidents).

Every criterion says PASS or FAIL and why, with the numbers it judged. Times are measured
from the fault (the first ``fault_injected`` event of the drill's fault kind).
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from typing import Any

from trainwatch.rundir.attempts import rank_of
from trainwatch.contract.layout import TORCHRUN_LOG
from trainwatch.drill import catalog, score_nodes, score_replicas
from trainwatch.drill.catalog import (ALERT, CONTROLLER, EVENT, FINDING, LAUNCHER, NONE,
                                      REPAIR, RERUN, SUPERVISOR, TORCHRUN, Drill)
from trainwatch.drill.record import RECORD_FORMAT, RECORD_VERSION, record_file
from trainwatch.errors import ConfigError, FormatError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import read_run_file

FORMAT = "trainwatch.drill"
VERSION = 1
CRITERIA = ("fault injected", "detected", "recovered", "run finished", "steps lost",
            "no duplicate actions")
# torchrun's line for a failed worker, with its glog prefix (local time, no year):
# E1202 14:59:14.580000 11755 .../api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 11875)


def criteria_names(drill: Drill) -> tuple[str, ...]:
    """Every drill's criteria, then the drill's own (sdc: score_replicas; the multi-node
    drills: score_nodes)."""
    return (CRITERIA + (score_replicas.CRITERIA if score_replicas.applies(drill) else ())
            + (score_nodes.CRITERIA if score_nodes.applies(drill) else ()))


_TORCHRUN_FAILED = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+)?\s.*?"
                              r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", re.M)


# --------------------------------------------------------------------------- reading

def read_record(run: RunDir) -> dict[str, Any]:
    """The drill's record, or a ConfigError (exit 2) saying why there is none."""
    path = record_file(run)
    if not run.exists():
        raise ConfigError("no such run directory", file=str(run.root))
    try:
        record = json.loads(read_run_file(path, run.root))
    except FileNotFoundError:
        raise ConfigError("missing: not a drill's run directory (trainwatch drill run writes "
                          "it)", file=str(path)) from None
    except (OSError, FormatError, ValueError, RecursionError) as exc:
        raise ConfigError(f"unreadable or not JSON ({exc})", file=str(path)) from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise ConfigError(f"not a {RECORD_FORMAT} file", file=str(path))
    if not isinstance(record.get("version"), int) or record["version"] > RECORD_VERSION:
        raise ConfigError(f"version {record.get('version')!r} is not supported (this "
                          f"trainwatch reads {RECORD_VERSION})", file=str(path), key="version")
    return record


def launcher_failures(run: RunDir, near: float) -> list[float]:
    """Times torchrun logged a failed worker; its log has no year, so take ``near``'s."""
    try:
        text = run.log_text(TORCHRUN_LOG)
    except (OSError, FormatError):
        return []
    year = time.localtime(near).tm_year
    times = []
    for month, day, hour, minute, second, fraction, *_ in _TORCHRUN_FAILED.findall(text):
        try:
            t = time.mktime((year, int(month), int(day), int(hour), int(minute), int(second),
                             0, 0, -1)) + float(fraction or 0)
        except (OverflowError, ValueError):
            continue
        if t - near > 183 * 86400:  # a log line from December, read in January
            t = time.mktime((year - 1, int(month), int(day), int(hour), int(minute),
                             int(second), 0, 0, -1)) + float(fraction or 0)
        times.append(t)
    return sorted(times)


def _signal_times(signal: catalog.Signal, run: RunDir, events: list[dict[str, Any]],
                  findings: list[dict[str, Any]], fault_at: float) -> list[float]:
    if signal.kind == ALERT:
        times = [e["time"] for e in events
                 if e["event"] == "alert_firing" and e.get("alert") == signal.name]
    elif signal.kind == FINDING:
        times = [f["detected_at"] for f in findings if f.get("kind") == signal.name
                 and isinstance(f.get("detected_at"), (int, float))]
    elif signal.kind == LAUNCHER:
        times = launcher_failures(run, fault_at)
    elif signal.kind == SUPERVISOR:
        times = [e["time"] for e in events if _supervisor_signal(signal.name, e)]
    elif signal.kind == EVENT:
        times = [e["time"] for e in events if e["event"] == signal.name]
    else:
        times = []
    return sorted(t for t in times if t >= fault_at)


def _supervisor_signal(name: str, event: dict[str, Any]) -> bool:
    """Whether a journal event is the supervisor drills' signal ``name`` (catalog)."""
    if name == "tree-gone":
        return event["event"] == "supervisor_tree_gone"
    if name == "leftovers-stopped":
        return event["event"] == "leftovers_stopped" and not event.get("left")
    return (name == "refused" and event["event"] == "second_supervisor_exited"
            and event.get("exit_code") == 2 and event.get("named_holder") is True)


# --------------------------------------------------------------------------- scoring

def _verdict(name: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": passed, "detail": detail}


def _secs(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def score(run: RunDir, *, detect_within: float | None = None,
          recover_within: float | None = None) -> dict[str, Any]:
    """The scorecard of one drill's run directory (keys: docs/drill.md)."""
    from trainwatch.report import cost, goodput, render, timeline

    record = read_record(run)
    try:
        drill = catalog.get(str(record.get("drill")))
    except ConfigError as exc:
        raise ConfigError(exc.problem, file=str(record_file(run)), key="drill") from None
    if not run.journal_file.exists():
        raise ConfigError("missing: the run left no journal, so there is nothing to score "
                          f"(see {run.drill_log})", file=str(run.journal_file))
    settings = record.get("settings") or {}
    detect_within = settings.get("detect_within_seconds", drill.detect_within) \
        if detect_within is None else detect_within
    recover_within = settings.get("recover_within_seconds", drill.recover_within) \
        if recover_within is None else recover_within
    every = settings.get("steps_lost_max")
    tl = timeline.read_timeline(run)
    report = render.report(tl, goodput.account(tl), cost.CostSettings())
    events = tl.events
    findings = [f for f in record.get("findings") or [] if isinstance(f, dict)]

    faults = [e for e in events if e["event"] == "fault_injected"
              and e.get("fault") == drill.fault_kind]
    card: dict[str, Any] = {
        "name": drill.name, "simulates": drill.simulates, "fault": drill.fault,
        "run_dir": str(run.root), "passed": False,
        "run": {"exit_code": record.get("exit_code"), "timed_out": bool(record.get("timed_out")),
                "interrupted": bool(record.get("interrupted")), "state": tl.state,
                "seconds": _elapsed(record)},
        "fault_injected": None, "detection": None, "recovery": None, "steps": None,
        "alerts": [], "actions": [], "findings": findings, "criteria": [],
        "report": {"wall_seconds": report["time"]["wall_seconds"],
                   "goodput_ratio": report["goodput_ratio"],
                   "steps_recomputed": report["steps"]["recomputed"],
                   "incidents": [{"cause": i["cause"], "steps_lost": i["steps_lost"],
                                  "restart_downtime_seconds": i["restart_downtime_seconds"]}
                                 for i in report["incidents"]],
                   "warnings": report["warnings"]},
        "settings": settings}
    finished = _finished(card["run"], tl)
    if not faults:
        last = max(tl.execs.step_numbers(), default=None)
        why = (f"no fault_injected event for {drill.fault_kind}: the run reached step "
               f"{last if last is not None else 'none'}, the fault was due at step "
               f"{drill.fault_step}")
        names = criteria_names(drill)
        card["criteria"] = [_verdict("fault injected", False, why), finished] + [
            _verdict(n, False, "not scored: no fault was injected")
            for n in names if n not in ("fault injected", "run finished")]
        card["criteria"].sort(key=lambda c: names.index(c["name"]))
        return card
    fault = faults[0]
    t0 = fault["time"]
    card["fault_injected"] = {"at": t0, "step": fault.get("step"),
                              "rank": rank_of(fault),
                              "seconds_into_run": round(t0 - record.get("started_at", t0), 3)}
    card["alerts"] = [{"alert": e.get("alert"), "rank": (e.get("labels") or {}).get("rank"),
                       "suspects": (e.get("labels") or {}).get("suspects"),
                       "severity": e.get("severity"), "at": e["time"],
                       "seconds": round(e["time"] - t0, 3)}
                      for e in events if e["event"] == "alert_firing"]
    card["actions"] = [{"action": e.get("action"), "taken": e["event"] == "action_taken",
                        "alert": e.get("alert"), "reason": e.get("reason"), "at": e["time"],
                        "seconds": round(e["time"] - t0, 3)}
                       for e in events if e["event"] in ("action_taken", "action_skipped")]

    detection = _detection(drill, run, events, findings, t0)
    card["detection"] = detection
    restarts = [a for a in tl.attempts if a.started_at > t0]
    recovery = _recovery(drill, restarts, t0)
    card["recovery"] = recovery
    steps_lost = None
    if restarts and restarts[0].resumed_from is not None and isinstance(fault.get("step"), int):
        steps_lost = max(0, fault["step"] - restarts[0].resumed_from)
    elif not restarts:
        steps_lost = 0
    card["steps"] = {"fault_step": fault.get("step"), "resumed_from": recovery["resumed_from"],
                     "resumed_with": restarts[0].resumed_with if restarts else None,
                     "lost": steps_lost, "recomputed": report["steps"]["recomputed"],
                     "checkpoint_interval": settings.get("checkpoint_every", every),
                     "lost_max": every}

    where = (f"trainwatch run (pid {fault.get('pid') or fault.get('holder')})"
             if drill.supervisor_fault else f"rank {card['fault_injected']['rank']}")
    if drill.node_fault:
        card["fault_injected"]["node"] = fault.get("node")
        where = (f"node {fault.get('node')} (ranks {fault.get('ranks')})"
                 if card["fault_injected"]["rank"] is None else f"{where} on node "
                 f"{fault.get('node')}")
    criteria = [_verdict("fault injected", True,
                         f"{drill.fault_kind} on {where} at step "
                         f"{fault.get('step')}, {_secs(card['fault_injected']['seconds_into_run'])}"
                         " into the drill")]
    criteria.append(_detected(drill, detection, detect_within))
    criteria.append(_recovered(drill, recovery, card["actions"], restarts, recover_within))
    criteria.append(finished)
    criteria.append(_steps_lost(card["steps"], restarts))
    # Only the drill's own rerun may start a supervisor after the fault: never two jobs.
    supervisors = [e for e in events if e["event"] == "controller_started" and e["time"] > t0]
    criteria.append(_duplicates(card["actions"], restarts, len(supervisors),
                                1 if drill.recovery == RERUN else 0))
    if score_replicas.applies(drill):
        criteria += score_replicas.criteria(drill, run, events, tl.execs, fault.get("step"),
                                            t0, recovery["resumed_from"])
    if score_nodes.applies(drill):
        card["nodes"] = score_nodes.restarts_by_node(record, events, t0)
        criteria += score_nodes.criteria(drill, card["nodes"], fault)
    card["criteria"] = criteria
    card["passed"] = all(c["passed"] for c in criteria)
    return card


def _elapsed(record: dict[str, Any]) -> float | None:
    start, end = record.get("started_at"), record.get("ended_at")
    if isinstance(start, (int, float)) and isinstance(end, (int, float)):
        return round(end - start, 3)
    return None


def _detection(drill: Drill, run: RunDir, events, findings, t0: float) -> dict[str, Any]:
    signals: list[dict[str, Any]] = []
    for signal in drill.detect:
        times = _signal_times(signal, run, events, findings, t0)
        signals.append({**signal.to_json(), "at": times[0] if times else None,
                        "seconds": round(times[0] - t0, 3) if times else None})
    seen = [s for s in signals if s["at"] is not None]
    first = min(seen, key=lambda s: s["at"]) if seen else None
    return {"expected": [str(s) for s in drill.detect], "signals": signals,
            "first": first["text"] if first else None,
            "seconds": first["seconds"] if first else None}


def _detected(drill: Drill, detection: dict[str, Any], within: float) -> dict[str, Any]:
    if detection["first"] is None:
        return _verdict("detected", False, "not detected: no " + " and no ".join(
            detection["expected"]) + " after the fault")
    others = "; ".join(f"{s['text']} after {_secs(s['seconds'])}"
                       for s in detection["signals"]
                       if s["at"] is not None and s["text"] != detection["first"])
    text = f"{detection['first']} after {_secs(detection['seconds'])}"
    if detection["seconds"] > within:
        return _verdict("detected", False,
                        f"too late: {text}, more than the {within:g} s allowed"
                        + (f" ({others})" if others else ""))
    return _verdict("detected", True, f"{text} (within {within:g} s)"
                    + (f"; {others}" if others else ""))


def _recovery(drill: Drill, restarts, t0: float) -> dict[str, Any]:
    first = restarts[0] if restarts else None
    first_step_at = first.execs[0].end if first is not None and first.execs else None
    by = None
    if first is not None and drill.recovery == RERUN:
        by = "rerun"
    elif first is not None:
        by = "torchrun" if (first.restart_count or 0) > 0 else "controller"
    return {"expected": drill.expected_recovery(), "action": drill.action,
            "restarts": len(restarts), "by": by,
            "resumed_from": first.resumed_from if first is not None else None,
            "first_step_at": first_step_at,
            "seconds": round(first_step_at - t0, 3) if first_step_at is not None else None}


def _recovered(drill: Drill, recovery: dict[str, Any], actions, restarts,
               within: float | None) -> dict[str, Any]:
    taken = [a for a in actions if a["taken"] and a["seconds"] >= 0]
    names = [a["action"] for a in taken]
    if drill.action is not None and drill.action not in names:
        return _verdict("recovered", False, f"no {drill.action} action was taken"
                        + (f" (taken: {', '.join(names)})" if names else " (none taken)"))
    if drill.recovery == NONE:
        if restarts:
            return _verdict("recovered", False, f"the job was restarted ({recovery['by']}), "
                            "although this failure needs no restart")
        return _verdict("recovered", True, f"{drill.action} taken; the run went on without "
                        "a restart" if drill.action else "the run went on without a restart")
    if drill.recovery == TORCHRUN and (recovery["by"] != "torchrun" or names):
        how = (f"the controller acted ({', '.join(names)})" if names
               else "no torchrun restart" if not restarts else "the job was restarted "
               f"by the {recovery['by']}")
        return _verdict("recovered", False, f"expected torchrun to restart the ranks: {how}")
    if drill.recovery == CONTROLLER and recovery["by"] != "controller":
        return _verdict("recovered", False, f"{drill.action} was taken, but "
                        + ("the job was not restarted" if not restarts
                           else f"the ranks were restarted by {recovery['by']}"))
    if drill.recovery == REPAIR and recovery["by"] != "torchrun":
        return _verdict("recovered", False, f"{drill.action} was taken, but "
                        + ("the job was not restarted" if not restarts else "a launcher was "
                           "restarted (and with node 1's the rendezvous store)"))
    if drill.recovery == RERUN and recovery["by"] != "rerun":
        return _verdict("recovered", False, "the command run again trained no job")
    if recovery["first_step_at"] is None:
        return _verdict("recovered", False, "no step completed after the restart")
    by = {CONTROLLER: str(drill.action), RERUN: "running the same command again",
          REPAIR: f"{drill.action} on every node"}
    text = (f"by {by.get(drill.recovery, 'torchrun')}: first step "
            f"after resuming from step {recovery['resumed_from']} completed "
            f"{_secs(recovery['seconds'])} after the fault")
    if within is not None and recovery["seconds"] > within:
        return _verdict("recovered", False, f"too slow: {text}, more than {within:g} s")
    return _verdict("recovered", True, text + (f" (within {within:g} s)" if within else ""))


def _finished(run_info: dict[str, Any], tl) -> dict[str, Any]:
    code = run_info["exit_code"]
    if run_info["interrupted"]:
        return _verdict("run finished", False, "the drill was interrupted (Ctrl-C)")
    if run_info["timed_out"]:
        return _verdict("run finished", False, "timed out: the run was stopped after "
                        f"{_secs(run_info['seconds'])}")
    last = tl.execs[-1].step if tl.execs else None
    if tl.state == "finished" and code == 0:
        return _verdict("run finished", True, f"finished at step {last}; trainwatch run "
                        "exited 0")
    return _verdict("run finished", False, f"run {tl.state} at step {last}; trainwatch run "
                    f"exited {code}")


def _steps_lost(steps: dict[str, Any], restarts) -> dict[str, Any]:
    lost, every = steps["lost"], steps["lost_max"]
    if lost is None:
        return _verdict("steps lost", False, "unknown: the restarted job's resume step is "
                        "not in the run directory")
    if not restarts:
        return _verdict("steps lost", lost == 0, "none: no restart")
    source = steps.get("resumed_with") or "checkpoint"
    text = (f"{lost} (fault at step {steps['fault_step']}, resumed from {source}, step "
            f"{steps['resumed_from']})")
    interval = steps["checkpoint_interval"]
    limit = (f"checkpoint interval {every}" if every == interval else
             f"{every} with memory snapshots (checkpoint interval {interval})")
    if every is not None and lost > every:
        return _verdict("steps lost", False, f"{text}: more than {limit} (an older state "
                        "was used)")
    return _verdict("steps lost", True, text + (f" <= {limit}" if every is not None else ""))


def _duplicates(actions, restarts, supervisors: int = 0, allowed: int = 0) -> dict[str, Any]:
    counts = Counter(a["action"] for a in actions if a["taken"])
    twice = {name: n for name, n in counts.items() if n > 1}
    problems = [f"{name} taken {n} times" for name, n in sorted(twice.items())]
    if len(restarts) > 1:
        problems.append(f"the job was restarted {len(restarts)} times for one fault")
    if supervisors > allowed:
        problems.append(f"{supervisors} supervisors started a job after the fault (expected "
                        f"{allowed})")
    if problems:
        return _verdict("no duplicate actions", False, "; ".join(problems))
    done = ", ".join(f"{name} once" for name in sorted(counts)) or "no action taken"
    return _verdict("no duplicate actions", True,
                    f"{done}; {len(restarts)} restart{'s' if len(restarts) != 1 else ''}")


def unscored(drill: Drill, run: RunDir, reason: str) -> dict[str, Any]:
    """The scorecard of a drill whose run left nothing to score (it never started)."""
    record: dict[str, Any] = {}
    try:
        record = read_record(run)
    except ConfigError:
        pass
    return {"name": drill.name, "simulates": drill.simulates, "fault": drill.fault,
            "run_dir": str(run.root), "passed": False,
            "run": {"exit_code": record.get("exit_code"),
                    "timed_out": bool(record.get("timed_out")),
                    "interrupted": bool(record.get("interrupted")), "state": None,
                    "seconds": _elapsed(record)},
            "fault_injected": None, "detection": None, "recovery": None, "steps": None,
            "alerts": [], "actions": [], "findings": record.get("findings") or [],
            "criteria": [_verdict(name, False, reason if name == "run finished"
                                  else "not scored: the run left nothing to score")
                         for name in criteria_names(drill)],
            "report": None, "settings": record.get("settings") or {}}


def summary(cards: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole ``--json`` document."""
    return {"format": FORMAT, "version": VERSION, "passed": all(c["passed"] for c in cards),
            "drills": cards}
