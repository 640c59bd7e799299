"""Drills for people: the catalog, the live progress of a drill, and the scorecard.

Tables are rich tables, drawn in plain ASCII when the output is not a terminal (logs, CI).
The JSON documents come from the same dictionaries, so the two views never disagree.
"""

from __future__ import annotations

import json
from typing import Any

from rich import box
from rich.console import Console
from rich.status import Status
from rich.table import Table
from rich.text import Text

from trainwatch.contract.env import FAULT_ENV
from trainwatch.drill.catalog import DRILLS, Drill
from trainwatch.drill.settings import settings_for


def console_for(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=120,
                                                       no_color=True)


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2)


# --------------------------------------------------------------------------- the catalog

def catalog_json(changed: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {"format": "trainwatch.drill.catalog", "version": 1, "drills": [
        {"name": d.name, "simulates": d.simulates, "fault": d.fault, "fault_env": d.fault_env(),
         "detection": [s.to_json() for s in d.detect], "recovery": d.recovery,
         "expected_recovery": d.expected_recovery(), "action": d.action,
         "criteria": {"detect_within_seconds": d.detect_within,
                      "recover_within_seconds": d.recover_within,
                      # the bound the score applies: 1 where memory snapshots outlive
                      # the fault, else the drill's checkpoint interval (settings.py)
                      "steps_lost_max": settings_for(d).steps_lost_max, "run_finishes": True,
                      "no_duplicate_actions": True,
                      **({"detect_within_steps": d.detect_within_steps,
                          "suspect_named": True, "clean_checkpoint": True,
                          "replicas_agree_at_the_end": True}
                         if d.detect_within_steps is not None else {})},
         "steps": d.steps, "nproc_per_node": d.nproc_per_node, "nnodes": d.nnodes,
         "max_restarts": d.max_restarts, "notes": d.notes,
         "changed_defaults": changed[d.name]} for d in DRILLS]}


def _changes(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['key']} {r['drill']} (default {r['default']})" for r in rows)


CRITERIA_TEXT = ("the fault fired; detected within the drill's deadline; recovered as "
                 "expected, with the first step after resuming within its deadline; the run "
                 "finishes; steps lost <= 1 where the ranks resume from their memory snapshots "
                 "(steps_lost_max in --json), else <= the checkpoint interval; no action taken twice and "
                 "at most one restart; sdc also: the alert names the corrupted rank "
                 "within its step allowance, the job resumes from a checkpoint saved before "
                 "the flip, and every rank's last digest is equal")


def render_catalog(console: Console, changed: dict[str, list[dict[str, Any]]]) -> None:
    table = _table("trainwatch drills")
    for col in ("drill", "simulates", FAULT_ENV, "detected by (any)", "recovery"):
        # A fault value is copied into a shell: never broken inside, only at its commas.
        table.add_column(col, overflow="fold", no_wrap=col == FAULT_ENV)
    for d in DRILLS:
        recovery = d.expected_recovery()
        if d.recover_within is not None:
            recovery += f"; first step within {d.recover_within:g} s"
        table.add_row(d.name, d.simulates, d.fault_env().replace(",", ",\n"),
                      "\n".join(map(str, d.detect)) + f"\nwithin {d.detect_within:g} s",
                      recovery)
    console.print(table)
    console.print(Text(f"Pass criteria: {CRITERIA_TEXT}."))
    common = [r for r in changed[DRILLS[0].name]
              if all(r in rows for rows in changed.values())]
    console.print(Text(f"Drills run the reference trainer (it honours {FAULT_ENV}) under "
                       "`trainwatch run`, with shorter waits than production so that a drill "
                       f"takes a minute: {_changes(common)}; and"))
    for d in DRILLS:
        extra = [r for r in changed[d.name] if r not in common]
        if extra:
            console.print(Text(f"  {d.name}: {_changes(extra)}"))
    console.print("Each drill's notes and trainer settings: trainwatch drill list --json; "
                  "docs/drill.md")


# --------------------------------------------------------------------------- progress

def progress_line(drill: Drill, snap: dict[str, Any]) -> str:
    parts = [f"{drill.name}: {snap['elapsed']:.0f} s", f"step {snap['step']}"
             if snap["step"] is not None else "step -"]
    faults = [f for f in snap["faults"] if f.get("fault") == drill.fault_kind]
    if faults:
        parts.append(f"fault {drill.fault_kind} at step {faults[0].get('step')}")
    if snap["findings"]:
        parts.append("findings: " + ", ".join(snap["findings"]))
    if snap["alerts"]:
        parts.append("alerts: " + ", ".join(snap["alerts"]))
    if snap["actions"]:
        parts.append("actions: " + ", ".join(snap["actions"]))
    if snap["resumed"]:
        parts.append("resumed")
    if snap["finished"]:
        parts.append("finished")
    return " · ".join(parts)


class Progress:
    """A spinner with the drill's story on a terminal; elsewhere one line per new milestone."""

    def __init__(self, console: Console, drill: Drill):
        self.console = console
        self.drill = drill
        self.name = drill.name
        self.status: Status | None = None
        self._last: list[str] | None = None

    def __enter__(self) -> "Progress":
        if self.console.is_terminal:
            self.status = self.console.status(f"{self.name}: starting trainwatch run")
            self.status.__enter__()
        else:
            self.console.print(f"{self.name}: starting trainwatch run")
        return self

    def update(self, snap: dict[str, Any]) -> None:
        line = progress_line(self.drill, snap)
        if self.status is not None:
            self.status.update(line)
            return
        milestone = line.split(" · ", 2)[2:]  # leave out the clock and the step
        if milestone != self._last:
            self._last = milestone
            self.console.print(line)

    def __exit__(self, *exc: Any) -> None:
        if self.status is not None:
            self.status.__exit__(*exc)


# --------------------------------------------------------------------------- scorecards

def _secs(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def render_card(card: dict[str, Any], console: Console) -> None:
    verdict = Text("PASS", style="bold green") if card["passed"] else Text("FAIL",
                                                                             style="bold red")
    console.print(Text.assemble(f"drill {card['name']}: ", verdict,
                                f"  ({_secs(card['run']['seconds'])}, fault {card['fault']})"))
    console.print(Text(f"  simulates: {card['simulates']}"))
    table = _table("")
    for col in ("criterion", "result", "why"):
        table.add_column(col, overflow="fold")
    for c in card["criteria"]:
        table.add_row(c["name"], Text("PASS", style="green") if c["passed"]
                      else Text("FAIL", style="red"), c["detail"])
    console.print(table)
    if card["alerts"] or card["actions"]:
        story = [f"{a['alert']} fired" + _who(a) + f" {a['seconds']:+.1f} s"
                 for a in card["alerts"]]
        story += [f"{a['action']} {'taken' if a['taken'] else 'skipped'} {a['seconds']:+.1f} s"
                  for a in card["actions"]]
        console.print(Text("  after the fault: " + "; ".join(story)))
    changes = (card.get("settings") or {}).get("changed_defaults") or []
    if changes:
        console.print(Text(f"  drill settings: {_changes(changes)}"))
    where = card["run_dir"] + ("" if card.get("kept", True) else " (removed)")
    console.print(Text(f"  run directory: {where}"))


def render_summary(cards: list[dict[str, Any]], console: Console) -> None:
    if len(cards) > 1:
        table = _table("Game day")
        for col in ("drill", "result", "detected after", "first step after resume",
                    "steps lost", "actions taken"):
            table.add_column(col, overflow="fold")
        for card in cards:
            det, rec, steps = card["detection"], card["recovery"], card["steps"]
            taken = [a["action"] for a in card["actions"] if a["taken"]]
            table.add_row(card["name"], "PASS" if card["passed"] else "FAIL",
                          _secs(det["seconds"]) if det else "-",
                          _secs(rec["seconds"]) if rec else "-",
                          str(steps["lost"]) if steps and steps["lost"] is not None else "-",
                          ", ".join(taken) or "-")
        console.print(table)
    passed = sum(c["passed"] for c in cards)
    console.print(Text(f"{passed} of {len(cards)} drill(s) passed",
                       style="bold green" if passed == len(cards) else "bold red"))


def _who(alert: dict[str, Any]) -> str:
    """Whom an alert named: the suspects of a divergence, a rank, or no one (job-wide)."""
    if alert.get("suspects") is not None:
        return f" (suspects {alert['suspects']})"
    return "" if alert["rank"] is None else f" (rank {alert['rank']})"
