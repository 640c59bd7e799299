"""The report as one dictionary (``--json``, keys documented in docs/report.md) and as text.

The human view is drawn from the same dictionary, so the two never disagree.
"""

from __future__ import annotations

import json
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainwatch.rundir import attempts
from trainwatch.contract.layout import CONFIG_DIGEST_KEY, WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.report import cost as cost_mod
from trainwatch.report.cost import CostSettings
from trainwatch.report.goodput import CATEGORIES, Accounting
from trainwatch.report.hint import checkpoint_hint
from trainwatch.report.timeline import Timeline

FORMAT = "trainwatch.report"
VERSION = 1
SKIPPED_EXAMPLES = 10
# Start-up and shutdown above this share of the wall time: the goodput line of a short run
# says why it is low (a demo's 60 steps, a smoke test), not a failure.
FIXED_COST_NOTE = 0.5

_CATEGORY_TEXT = {
    "productive": "productive steps",
    "data_wait": "waiting for data (steps' data phase, not productive)",
    "recomputed": "recomputed (lost to restarts)",
    "restart_downtime": "restart downtime",
    "initial_startup": "initial start-up",
    "checkpoint": "checkpoint saves (loop blocked)",
    "evaluation": "evaluation",
    "stalled": "stalled",
    "shutdown": "shutdown after the last step",
    "other": "other / unaccounted",
}


# --------------------------------------------------------------------------- the dictionary

def _attempt(a, seconds: float, settings: CostSettings) -> dict[str, Any]:
    held = cost_mod.accelerators(settings, a.world_size)[0]
    return {"index": a.index, "restart_count": a.restart_count, "restarted_by": a.restarted_by,
            "started_at": a.started_at, "world_size": a.world_size,
            "wall_seconds": seconds, "accelerators": held,
            "cost": cost_mod.incident_cost(seconds, settings, a.world_size),
            "ended_at": a.ended_at, "outcome": a.outcome, "ranks": len(a.ranks),
            "resumed_from": a.resumed_from, "resume_source": a.resume_source,
            "resumed_with": a.resumed_with,
            "first_step": a.execs[0].step if a.execs else None,
            "last_step": a.execs[-1].step if a.execs else None, "steps": len(a.execs)}


def _completed(tl: Timeline) -> int | None:
    """Steps completed, as diagnose and a checkpoint count them: the last step number + 1."""
    last = next((a.execs[-1].step for a in reversed(tl.attempts) if a.execs), None)
    return None if last is None else last + 1


def report(tl: Timeline, acc: Accounting, settings: CostSettings) -> dict[str, Any]:
    world = tl.world_size
    incidents = []
    for inc in acc.incidents:
        a = inc.attempt
        incidents.append({
            "kind": "attempt" if a is not None else "supervisor_died",
            "attempt": a.index if a else None, "restart_count": a.restart_count if a else None,
            "time": inc.time, "outcome": a.outcome if a else "supervisor_died",
            "cause": inc.cause,
            "last_step": a.execs[-1].step if a and a.execs else None,
            "resumed_from": inc.resumed_from, "steps_lost": len(inc.lost_steps),
            "lost_steps": ({"first": inc.lost_steps[0], "last": inc.lost_steps[-1]}
                           if inc.lost_steps else None),
            "recomputed_seconds": inc.seconds["recomputed"],
            "restart_downtime_seconds": inc.seconds["restart_downtime"],
            "stalled_seconds": inc.seconds["stalled"],
            "total_seconds": inc.total_seconds,
            "cost": cost_mod.incident_cost(inc.total_seconds, settings,
                                           a.world_size if a else world),
            "evidence": inc.evidence,
        })
    return {
        "format": FORMAT, "version": VERSION,
        "run_dir": str(tl.run_dir), "job": tl.job, "state": tl.state, "world_size": world,
        "digests": {key: tl.info.get(key) if isinstance(tl.info.get(key), str) else None
                    for key in (CONFIG_DIGEST_KEY, WEIGHTS_CONFIG_DIGEST_KEY)},
        "time": {"start": tl.start, "end": tl.end, "span_seconds": acc.span_seconds,
                 "not_running_seconds": acc.not_running_seconds,
                 "wall_seconds": acc.wall_seconds},
        "categories": dict(acc.seconds),
        "goodput_ratio": acc.goodput_ratio,
        "effective_training_time_ratio": acc.effective_training_time_ratio,
        "steps": {"completed": _completed(tl), "unique": acc.unique_steps, "executed": acc.executed_steps,
                  "recomputed": acc.recomputed_steps,
                  "target": tl.config("train", "steps"),
                  "unsaved": acc.unsaved_steps,
                  "typical_seconds": acc.typical_step_seconds,
                  "stall_budget_seconds": acc.stall_budget_seconds},
        "tokens": {"productive": acc.productive_tokens, "processed": acc.processed_tokens},
        "attempts": [_attempt(a, seconds, settings)
                     for a, seconds in zip(tl.attempts, cost_mod.attempt_seconds(tl))],
        "restarts": attempts.summary([a.restarted_by for a in tl.attempts]),
        "incidents": incidents,
        "cost": cost_mod.costs(acc, settings, tl),
        "checkpoint_hint": checkpoint_hint(tl, acc),
        "skipped": {"journal_lines": len(tl.skipped_journal),
                    "metrics_lines": len(tl.skipped_metrics),
                    "examples": [str(s) for s in
                                 (tl.skipped_journal + tl.skipped_metrics)[:SKIPPED_EXAMPLES]]},
        "warnings": list(tl.warnings),
    }


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=False)


# --------------------------------------------------------------------------- text

def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    if seconds >= 60:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def money(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}" if value >= 1 else f"${value:.4f}"


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f} %"


def _sizes(data: dict[str, Any]) -> str:
    """The world size, or each attempt's where a resume changed it (2 -> 1)."""
    sizes = [a["world_size"] for a in data["attempts"]]
    if len(set(sizes)) > 1:
        return " -> ".join(str(s) if s is not None else "?" for s in sizes)
    return str(data["world_size"] or "?")


def _after(when: float | None, start: float) -> str:
    """When an incident happened, from the run's start; a supervisor that died before its
    first launch did, before the run's span began."""
    if when is None:
        return "?"
    return duration(when - start) if when >= start else "before the start"


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)


def render(data: dict[str, Any], console: Console) -> None:
    t, steps, price = data["time"], data["steps"], data["cost"]["gpu_hour_price"]
    console.print(Text(f"trainwatch report: {data['run_dir']} (job {data['job']}, "
                       f"{data['state']})", style="bold"))
    console.print(f"wall time {duration(t['wall_seconds'])}, "
                  f"{attempts.describe(data['restarts'])}, world size {_sizes(data)}"
                  + (f"; not running for {duration(t['not_running_seconds'])} between launches"
                     if t["not_running_seconds"] else ""))
    console.print(f"goodput {percent(data['goodput_ratio'])} · effective training time ratio "
                  f"{percent(data['effective_training_time_ratio'])} · "
                  f"{steps['completed'] if steps['completed'] is not None else '?'} steps "
                  f"completed, {steps['unique']} unique" + (f" of {steps['target']}" if steps["target"] else "")
                  + f", {steps['executed']} executed, {steps['recomputed']} recomputed")
    wall = t["wall_seconds"]
    fixed = data["categories"]["initial_startup"] + data["categories"]["shutdown"]
    if wall and fixed / wall >= FIXED_COST_NOTE:
        console.print(f"start-up and shutdown take {percent(fixed / wall)} of this run's wall "
                      "time: fixed costs, which a longer run spreads thinner")

    table = _table("Where the time went")
    for col in ("category", "time", "share") + (("cost",) if price is not None else ()):
        table.add_column(col, justify="left" if col == "category" else "right")
    for c in CATEGORIES:
        seconds = data["categories"][c]
        row = [_CATEGORY_TEXT[c], duration(seconds), percent(seconds / wall if wall else None)]
        if price is not None:
            row.append(money(data["cost"]["by_category"][c]))
        table.add_row(*row)
    console.print(table)

    if data["incidents"]:
        table = _table("Incidents")
        for col in ("attempt", "after", "cause", "steps lost", "recomputed", "downtime",
                    "stalled", "total") + (("cost",) if price is not None else ()):
            table.add_column(col, overflow="fold", no_wrap=col != "cause")
        for i in data["incidents"]:
            lost = i["lost_steps"]
            row = [str(i["attempt"]) if i["attempt"] is not None else "none",
                   _after(i["time"], t["start"]),
                   i["cause"],
                   f"{i['steps_lost']}" + (f" ({lost['first']}-{lost['last']})" if lost else ""),
                   duration(i["recomputed_seconds"]), duration(i["restart_downtime_seconds"]),
                   duration(i["stalled_seconds"]), duration(i["total_seconds"])]
            if price is not None:
                row.append(money(i["cost"]))
            table.add_row(*row)
        console.print(table)
    else:
        console.print("no incidents: every attempt ran to its end")

    _render_cost(data, console)
    hint = data["checkpoint_hint"]
    if hint:
        console.print(f"checkpoint interval: every {hint['suggested_every_steps']} steps "
                      f"suggested (now {hint['current_every_steps'] or '?'}); {hint['basis']}")
    skipped = data["skipped"]
    if skipped["journal_lines"] or skipped["metrics_lines"]:
        console.print(f"skipped {skipped['journal_lines']} journal line(s) and "
                      f"{skipped['metrics_lines']} metrics line(s) that could not be read:")
        for line in skipped["examples"]:
            console.print(Text(f"  - {line}"))
    for warning in data["warnings"]:
        console.print(Text(f"warning: {warning}", style="yellow"))


def _render_cost(data: dict[str, Any], console: Console) -> None:
    c = data["cost"]
    if c["accelerators"] is None:
        console.print("cost: accelerators unknown; set gpus in --config or pass --gpus")
        return
    hours = f"{c['accelerator_hours']:.4g} accelerator-hours ({c['accelerators_source']})"
    if c["gpu_hour_price"] is None:
        console.print(f"cost: {hours}; pass --gpu-hour-price to price them")
        return
    line = (f"cost: {money(c['total'])} for {hours} at {money(c['gpu_hour_price'])} per "
            f"accelerator-hour; failures (recomputed, restarts, stalls) {money(c['failures'])}")
    if c["per_million_tokens"] is not None:
        line += f"; {money(c['per_million_tokens'])} per million productive tokens"
    console.print(line)
