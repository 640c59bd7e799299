"""Scoring the corpus: is diagnose's first finding the right rank and the right cause, how
long until something noticed the fault (an alert, an agent finding, a diagnose finding) and
until diagnose named it, and what was reported about a clean run (all of it false).

Torch-free: it reads the records the runner wrote, so a kept run can be scored again.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from trainwatch.drill.corpus.case import Case

FORMAT, VERSION = "trainwatch.drill.corpus", 1
# The goals of issue #36, beside the published figures of other systems (docs/benchmarks.md).
GOAL_RIGHT, GOAL_DETECT_S, GOAL_DIAGNOSE_S = 0.95, 10.0, 20.0
REPORTED = ("critical", "warning")  # severities that count as a finding (info does not)


def brief(finding: dict[str, Any]) -> dict[str, Any]:
    """What the record keeps of one diagnose finding."""
    return {k: finding.get(k) for k in ("category", "title", "severity", "confidence",
                                        "ranks", "nodes", "evidence", "cause")}


def _text(finding: dict[str, Any]) -> str:
    return " ".join([str(finding.get("title") or ""), *map(str, finding.get("evidence") or []),
                     json.dumps(finding.get("cause") or {})]).lower()


def right(case: Case, answer: dict[str, Any], nodes: list[str] | None = None
          ) -> dict[str, Any]:
    """Diagnose's first finding against the case's expected answer. ``nodes``: a
    multi-node case's node names, in order; a node-level fault's "rank" is right when the
    finding names no rank and exactly the expected nodes."""
    expect = case.expect
    assert expect is not None, "a clean run has no right answer, only false findings"
    findings = answer.get("findings") or []
    top = findings[0] if findings else {}
    rank = sorted(top.get("ranks") or []) == sorted(expect.ranks) and bool(top)
    if expect.nodes:
        wanted = sorted((nodes or [])[i] for i in expect.nodes if i < len(nodes or []))
        rank = rank and len(wanted) == len(expect.nodes) and \
            sorted(map(str, top.get("nodes") or [])) == wanted
    missing = [k for k in expect.cause if k.lower() not in _text(top)]
    cause = top.get("category") in expect.category and not missing
    return {"rank": rank, "cause": cause, "right": rank and cause,
            "title": top.get("title"), "category": top.get("category"),
            "ranks": top.get("ranks"), "nodes": top.get("nodes"), "missing": missing}


def false_findings(record: dict[str, Any]) -> list[str]:
    """Everything reported about a clean run: diagnose findings (warning or critical),
    alerts that fired, agent findings; each distinct one once."""
    seen: list[str] = []
    for answer in record["answers"]:
        for f in answer.get("findings") or []:
            if f.get("severity") in REPORTED:
                seen.append(f"diagnose: {f.get('title')}")
        if answer.get("error"):
            seen.append(f"diagnose failed: {answer['error']}")
    seen += [f"alert {a['alert']}" for a in record["alerts"]]
    seen += [f"agent finding {f.get('kind')}: {f.get('message')}"
             for f in record["agent_findings"]]
    return list(dict.fromkeys(seen))


def card(case: Case, record: dict[str, Any]) -> dict[str, Any]:
    """One run of one case, scored."""
    out: dict[str, Any] = {"kind": case.kind, "clean": case.expect is None,
                           "error": record.get("error"), "rank_right": False,
                           "cause_right": False, "detect_seconds": None,
                           "diagnose_seconds": None, "answer": None, "false_findings": [],
                           "detected_by": None}
    t0 = record.get("fault_at")
    if t0 is None:
        return out
    if case.expect is None:
        out["false_findings"] = false_findings(record)
        return out
    answers = record["answers"]
    verdicts = [(a, right(case, a, record.get("nodes"))) for a in answers]
    first_right = next(((a, v) for a, v in verdicts if v["right"]), None)
    best = first_right or (verdicts[-1] if verdicts else None)
    if best is not None:
        out["answer"] = best[1]
        out["rank_right"], out["cause_right"] = best[1]["rank"], best[1]["cause"]
    if first_right is not None:
        out["diagnose_seconds"] = round(first_right[0]["ended"] - t0, 1)
    signals = [(a["at"], f"alert {a['alert']}") for a in record["alerts"] if a["at"] >= t0]
    signals += [(f["detected_at"], f"agent finding {f.get('kind')}")
                for f in record["agent_findings"] if f["detected_at"] >= t0]
    signals += [(a["ended"], "diagnose") for a in answers
                if any(f.get("severity") in REPORTED for f in a.get("findings") or [])]
    if signals:
        at, by = min(signals)
        out["detect_seconds"], out["detected_by"] = round(at - t0, 1), by
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def _range(values: list[float]) -> list[float] | None:
    """The fastest and the slowest of a kind's runs: a median of three hides one slow run."""
    return [min(values), max(values)] if values else None


def table(cases: dict[str, Case], cards: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind and in all: rank right, cause right, detection, diagnosis, false findings,
    and whether the goals are met."""
    rows = []
    for kind in dict.fromkeys(c["kind"] for c in cards):
        mine = [c for c in cards if c["kind"] == kind]
        detect = [c["detect_seconds"] for c in mine if c["detect_seconds"] is not None]
        diag = [c["diagnose_seconds"] for c in mine if c["diagnose_seconds"] is not None]
        rows.append({"kind": kind, "simulates": cases[kind].simulates, "runs": len(mine),
                     "clean": mine[0]["clean"],
                     "rank_right": sum(c["rank_right"] for c in mine),
                     "cause_right": sum(c["cause_right"] for c in mine),
                     "both_right": sum(c["rank_right"] and c["cause_right"] for c in mine),
                     "detect_seconds": _median(detect), "diagnose_seconds": _median(diag),
                     "detect_range": _range(detect), "diagnose_range": _range(diag),
                     "false_findings": sum(len(c["false_findings"]) for c in mine),
                     "errors": [c["error"] for c in mine if c["error"]],
                     "answers": [c["answer"]["title"] for c in mine if c["answer"]]})
    faults = [c for c in cards if not c["clean"]]
    clean = [c for c in cards if c["clean"]]
    n = len(faults)
    both = sum(c["rank_right"] and c["cause_right"] for c in faults)
    detected = sum(c["detect_seconds"] is not None and c["detect_seconds"] <= GOAL_DETECT_S
                   for c in faults)
    diagnosed = sum(c["diagnose_seconds"] is not None
                    and c["diagnose_seconds"] <= GOAL_DIAGNOSE_S for c in faults)
    false = sum(len(c["false_findings"]) for c in clean)
    totals = {
        "fault_runs": n, "kinds": len({c["kind"] for c in faults}), "clean_runs": len(clean),
        "rank_right": sum(c["rank_right"] for c in faults),
        "cause_right": sum(c["cause_right"] for c in faults), "both_right": both,
        "both_right_ratio": round(both / n, 3) if n else None,
        "detected_within_goal": detected, "diagnosed_within_goal": diagnosed,
        "detect_seconds_median": _median([c["detect_seconds"] for c in faults
                                          if c["detect_seconds"] is not None]),
        "diagnose_seconds_median": _median([c["diagnose_seconds"] for c in faults
                                            if c["diagnose_seconds"] is not None]),
        "detect_seconds_max": max((c["detect_seconds"] for c in faults
                                   if c["detect_seconds"] is not None), default=None),
        "diagnose_seconds_max": max((c["diagnose_seconds"] for c in faults
                                     if c["diagnose_seconds"] is not None), default=None),
        "false_findings_clean": false}
    goals = {"right": bool(n) and both / n >= GOAL_RIGHT,
             "detect": bool(n) and detected == n, "diagnose": bool(n) and diagnosed == n,
             "clean": bool(clean) and false == 0}
    return {"format": FORMAT, "version": VERSION, "rows": rows, "totals": totals,
            "goals": {**goals, "met": all(goals.values()), "right_ratio": GOAL_RIGHT,
                      "detect_seconds": GOAL_DETECT_S, "diagnose_seconds": GOAL_DIAGNOSE_S},
            "runs": cards}
