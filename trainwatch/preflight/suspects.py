"""``sdc.suspect``: a node that a replica rollback suspected of silent data corruption is not fit
until someone clears it. The rollback leaves ``RUN_DIR/suspects/<node>.json``
(``trainwatch.host.suspects``); a GPU that computed wrong once without an error will again, and
no other check here can see it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import RunLayout
from trainwatch.preflight.model import Check, Request
from trainwatch.host.suspects import suspects_of

CHECK = "sdc.suspect"
RUNBOOK = "TrainingReplicaDivergence"


def folders(request: Request, cfg: dict[str, Any]) -> list[Path]:
    """Where records are looked for: the run directory's, then ``sdc.suspect_dirs``."""
    found = [RunLayout(request.run_dir).suspects_dir] if request.run_dir else []
    return found + [Path(p) for p in cfg["suspect_dirs"]]


def check_suspects(request: Request, cfg: dict[str, Any], node: str) -> Check:
    where = folders(request, cfg)
    if not where:
        return Check(CHECK, "skipped", "no --run-dir and no sdc.suspect_dirs: no suspect "
                     "records to read", runbook=RUNBOOK)
    records: list[dict[str, Any]] = []
    unreadable: list[str] = []
    for folder in where:
        found, bad = suspects_of(folder, node)
        unreadable += bad
        records += [{"file": str(path), "run": r.get("run"), "ranks": r.get("ranks"),
                     "time": r.get("time"), "alert": r.get("alert"),
                     "evidence": r.get("evidence")} for path, r in found]
    evidence = {"node": node, "folders": [str(f) for f in where], "records": records,
                "unreadable": unreadable}
    if records:
        first = records[0]
        when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first["time"]))
                if isinstance(first["time"], (int, float)) else "at an unknown time")
        odd = (first.get("evidence") or {}).get("first_odd_step")
        return Check(CHECK, "fail", f"node {node} is suspected of silent data corruption: "
                     f"rank(s) {first['ranks']} of run {first['run']} held weights unlike "
                     f"their replicas' from step {odd} ({when}); test or replace its GPUs, "
                     f"then clear it: rm {' '.join(r['file'] for r in records)}",
                     evidence, runbook=RUNBOOK)
    if unreadable:
        return Check(CHECK, "warn", f"{len(unreadable)} suspect record(s) could not be read: "
                     f"{unreadable[0]}", evidence, runbook=RUNBOOK)
    return Check(CHECK, "ok", f"no suspect record names node {node}", evidence,
                 runbook=RUNBOOK)
