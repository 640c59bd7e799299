"""The stall rule, once: how long a rank may go without completing a step.

budget = the phase's own budget (checkpoint, eval, init), else ``first_step_seconds``
before the rank has a typical step time, else max(``floor_seconds``, ``k`` x the typical
step time). The agent applies it live; ``diagnose`` and ``report`` apply it to a run
afterwards and prefer, in order, the budget the agent published (its /status), the
options the run recorded (the journal's ``controller_started`` event of ``trainwatch
run``), and these defaults, so all three give the same verdict for the same run.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Iterable

STALL_DEFAULTS: dict[str, Any] = {
    "floor_seconds": 5.0,          # never call a rank stalled sooner than this
    "k": 10.0,                     # ... nor sooner than k x its typical step time
    "first_step_seconds": 600.0,   # budget before a rank has a typical step time
    "heartbeat_stale_seconds": 5.0,  # a heartbeat older than this: the process is frozen
    "phase_budgets": {"checkpoint": 600.0, "eval": 300.0, "init": 600.0},
    "history": 50,                 # step times kept per rank for the typical value
}

# A rank busy on a CPU: it used this many cores (CPU seconds per second), or its main thread
# ran or waited to run this share of the time. The agent calls a rank with a silent
# heartbeat busy, not frozen, on this; the early stall action leaves a busy rank alone.
BUSY_CORES = 0.25
BUSY_MAIN_RUNNABLE = 0.8

# The journal event that records the options of the agent a run was watched by, and its key.
RECORD_EVENT = "controller_started"
RECORD_KEY = "stall"


def stall_budget(options: dict[str, Any], typical_step: float | None,
                 phase: str | None = None, *, use_phase: bool = True) -> float:
    """Seconds without a completed step after which a running rank counts as stalled."""
    phase_budgets = options.get("phase_budgets") or {}
    if use_phase and phase in phase_budgets:
        return float(phase_budgets[phase])
    if typical_step is None:
        return float(options["first_step_seconds"])
    return max(float(options["floor_seconds"]), float(options["k"]) * typical_step)


def heartbeat_stale(options: dict[str, Any], age: float | None) -> bool:
    """Is a heartbeat this old a sign that nothing in the process runs?"""
    return age is not None and age > float(options["heartbeat_stale_seconds"])


def default_options() -> dict[str, Any]:
    return copy.deepcopy(STALL_DEFAULTS)


def merged_options(given: Any) -> dict[str, Any]:
    """The defaults with the valid entries of ``given`` (a recorded, untrusted mapping)."""
    options = default_options()
    if not isinstance(given, dict):
        return options
    for key, default in STALL_DEFAULTS.items():
        value = given.get(key)
        if isinstance(default, dict):
            if isinstance(value, dict):
                options[key] = {str(k): float(v) for k, v in value.items()
                                if _positive(v)}
        elif isinstance(value, (int, float)) and _positive(value):
            options[key] = float(value) if isinstance(default, float) else int(value)
    return options


def recorded_options(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The stall options the run recorded (the newest record wins), or None."""
    found = None
    for event in events:
        if event.get("event") == RECORD_EVENT and isinstance(event.get(RECORD_KEY), dict):
            found = event[RECORD_KEY]
    return merged_options(found) if found is not None else None


def published_budget(agent_statuses: Iterable[dict[str, Any]], job: str | None
                     ) -> float | None:
    """The largest stall budget the agents' /status documents give the job's running
    ranks (the job is stalled only when every rank outlived its budget), or None."""
    budgets = []
    for doc in agent_statuses:
        for entry in doc.get("jobs") or []:
            if not isinstance(entry, dict) or (job and entry.get("job") != job):
                continue
            for rank in entry.get("ranks") or []:
                stall = rank.get("stall") if isinstance(rank, dict) else None
                budget = stall.get("budget_seconds") if isinstance(stall, dict) else None
                if (rank.get("state") == "running" and isinstance(budget, (int, float))
                        and _positive(budget)):
                    budgets.append(float(budget))
    return max(budgets) if budgets else None


def _positive(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and value > 0)
