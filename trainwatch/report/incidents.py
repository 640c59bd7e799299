"""Why an attempt ended: the evidence its journal window and torchrun's log hold, in one line.

The cause names what acted first and most specifically: an automatic action (and the
alert behind it), a requested stop, the rank torchrun saw die (exit code or signal), a
rank's own error, a fault drill, a non-finite loss. Evidence that is not there is not
made up: with none, the cause says so.
"""

from __future__ import annotations

import signal
from typing import Any

from trainwatch.rundir.attempts import rank_of
from trainwatch.contract.layout import JOB_LOG, TORCHRUN_LOG
from trainwatch.report.exit_order import exits_text
from trainwatch.report.not_running import LAUNCHER_ROLE
from trainwatch.report.timeline import Attempt
from trainwatch.rundir.torchrun_log import PEER_FAILURE

_ERROR_CHARS = 300


def _signal_name(code: int) -> str | None:
    try:
        return signal.Signals(-code).name if code < 0 else None
    except ValueError:
        return f"signal {-code}"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def evidence(attempt: Attempt) -> dict[str, Any]:
    """Structured facts about how ``attempt`` ended (stable keys; empty lists when none)."""
    failed = {rank_of(e): e for e in attempt.named("failed")}  # each rank's newest
    exits = [{"rank": x["rank"], "pid": x["pid"], "exitcode": x["exitcode"],
              "signal": _signal_name(x["exitcode"]), "seen_at": x.get("seen_at"),
              "recorded_at": _number(failed.get(x["rank"], {}).get("time")),
              "host": failed.get(x["rank"], {}).get("host")} for x in attempt.exits]
    errors = [{"rank": rank_of(e), "error": str(e.get("error", ""))[:_ERROR_CHARS]}
              for e in attempt.named("failed")]
    faults = [{"rank": rank_of(e), "step": e.get("step"), "fault": e.get("fault"),
               "node": e.get("node"), "pid": e.get("pid", e.get("holder"))}
              for e in attempt.named("fault_injected")]
    actions = [{"action": e.get("action"), "alert": e.get("alert"), "reason": e.get("reason")}
               for e in attempt.named("action_taken")]
    alerts = sorted({str(e["alert"]) for e in attempt.named("alert_firing") if e.get("alert")})
    nonfinite = sorted({e["step"] for e in attempt.named("nonfinite_detected")
                        if isinstance(e.get("step"), int)})
    stops = [e.get("step") for e in attempt.named("checkpoint_saved") if e.get("reason") == "stop"]
    exited = [{"event": e["event"], "exit_code": e.get("exit_code", e.get("returncode")),
               "reason": e.get("reason") or e.get("signal")}
              for e in attempt.named("launcher_exited", "job_exited", "job_stopped")]
    lost = [{"node": e.get("lost_node"), "ranks": e.get("ranks") or []}
            for e in attempt.named("node_lost")]
    returned = [str(e.get("lost_node")) for e in attempt.named("node_returned")]
    gone = {n["node"] for n in lost}  # a lost node's supervisor died with it: said already
    died = [{"pid": (e.get("previous") or {}).get("pid"), "node": e.get("node"),
             "role": (e.get("previous") or {}).get("role"), "last_beat_at": e.get("last_beat_at")}
            for e in attempt.named("supervisor_died") if e.get("node") not in gone]
    return {"lost_nodes": lost, "returned_nodes": returned, "supervisor_died": died,
            "exits": exits, "errors": errors,
            "faults": faults,
            "actions": actions,
            "alerts": alerts, "nonfinite_steps": nonfinite,
            "stopped_at_step": stops[0] if stops else None, "exited": exited,
            "vanished": list(attempt.vanished)}


# Who an end event is about, and the log in RUN_DIR/logs/ with its output.
_EXITED = {"job_exited": ("the job", JOB_LOG), "job_stopped": ("the job", JOB_LOG),
           "launcher_exited": ("the launcher", TORCHRUN_LOG)}


def cause(ev: dict[str, Any]) -> str:
    """One human line, most specific evidence first."""
    parts = []
    for lost in ev.get("lost_nodes", []):
        # The other ranks' failures follow from it (their collectives lost their peers).
        silent = ", ".join(str(r) for r in lost["ranks"])
        parts.append(f"node {lost['node']} lost (its supervisor and ranks {silent or 'none'} "
                     "fell silent)")
    returned = ev.get("returned_nodes", [])
    for node in returned:
        parts.append(f"node {node} returned: torchrun restarted the workers to take it back "
                     "in (a planned re-rendezvous)")
    for a in ev["actions"]:
        parts.append(f"{a['action']} by the controller" + (f" ({a['alert']})" if a["alert"]
                                                          else ""))
    died = ev.get("supervisor_died", [])
    for d in died:
        # Its job died with it (it ends with its supervisor): a stop, but nobody asked.
        # `trainwatch train` holding the run is its own launcher and supervisor.
        who = ("its launcher `trainwatch train`" if d.get("role") == LAUNCHER_ROLE
               else "its supervisor")
        parts.append(f"{who} (pid {d['pid']}) died without a word (SIGKILL, a crash "
                     "or an OOM kill; found by the next supervisor): the job stopped with it")
    if ev["stopped_at_step"] is not None and (returned or died):
        parts.append(f"checkpoint saved at step {ev['stopped_at_step']} as the workers were "
                     "stopped")
    elif ev["stopped_at_step"] is not None:
        parts.append(f"stopped on request, checkpoint saved at step {ev['stopped_at_step']}")
    elif not ev["actions"] and not died and (stops := [x for x in ev["exited"]
                                          if x["event"] == "job_stopped"]):
        # Ctrl-C, `systemctl stop`, bad input: the job's ranks ended by the stop, unsaved.
        parts.append(f"stopped by its supervisor ({stops[-1]['reason']}); nothing saved on "
                     "the stop")
    died = [x for x in ev["exits"] if x["exitcode"] != 0]
    parts += exits_text(ev["exits"], ev["errors"])
    # A rank's error that is a peer's failure seen from a collective is not the cause when a
    # rank vanished without a word (SIGKILLed) or another raised on its own.
    own = [e for e in ev["errors"] if not PEER_FAILURE.search(e["error"])]
    errors = own or ([] if ev["vanished"] else ev["errors"])
    if not died and not ev["actions"] and errors:
        first = errors[0]
        parts.append(f"rank {first['rank']} failed: {first['error'].splitlines()[0][:120]}"
                     if first["error"] else f"rank {first['rank']} failed")
    parts += drills_text(ev["faults"])
    if ev["nonfinite_steps"]:
        steps = ", ".join(map(str, ev["nonfinite_steps"][:5]))
        parts.append(f"non-finite loss or gradient at step {steps}")
    if ev["alerts"] and not ev["actions"]:
        parts.append(f"alerts firing: {', '.join(ev['alerts'])}")
    if not parts and (gone := ev["vanished"]):  # no supervisor said how it ended
        first = gone[0]
        parts.append(f"rank {first['rank']} (pid {first['pid']}) gone at step {first['step']} "
                     "without a final status (killed, or died before it could say why)"
                     if len(gone) == 1 else
                     f"ranks {', '.join(str(x['rank']) for x in gone)} gone without a final "
                     "status (killed, or died before they could say why); rank "
                     f"{first['rank']} fell silent first, at step {first['step']}")
    if not parts:
        for x in ev["exited"]:
            if x["exit_code"] not in (None, 0):
                who, log = _EXITED[x["event"]]
                parts.append(f"{who} exited with code {x['exit_code']}; no rank's failure was "
                             f"recorded (its log: logs/{log})")
    return "; ".join(parts) or "unknown: no failure evidence in the journal or torchrun's log"


def drills_text(faults: list[dict[str, Any]]) -> list[str]:
    """``fault drill: kill on ranks 1, 2 at step 15``; a drill that acted on a node or a
    supervisor (journaled with no rank) is named by what it acted on, never "rank None"."""
    drills: dict[tuple[str, str, str], list[int]] = {}
    for f in faults:
        where = (f"node {f['node']}" if f.get("node") is not None
                 else f"trainwatch run (pid {f['pid']})" if f.get("pid") is not None
                 and f["rank"] is None else "")
        drills.setdefault((str(f["fault"]), str(f["step"]), where), []).extend(
            [f["rank"]] if f["rank"] is not None else [])
    parts = []
    for (fault, step, where), ranks in drills.items():
        on = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
              ] if ranks else []
        parts.append(" on ".join([f"fault drill: {fault}"] + on + ([where] if where else []))
                     + (f" at step {step}" if step != "None" else ""))
    return parts
