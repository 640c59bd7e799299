"""A checkpoint interval suggestion from what this run measured (Young/Daly's first order rule).

Saving more often costs blocking time on every save; saving less often loses more steps
per failure. Young (1974) and Daly (2006) balance the two: interval ~ sqrt(2 x save cost
x mean time between failures). The inputs here are this run's own: its median blocking
save time and its wall time per failure. One run with one or two failures gives a rough
MTBF, and the suggestion says so; with no failure or no save there is none.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from trainwatch.plan.interval import young_daly_interval
from trainwatch.report.goodput import Accounting
from trainwatch.report.timeline import Timeline, number


def _observed_every_steps(events: Sequence[dict[str, Any]]) -> int | None:
    """A job without the reference trainer's config (``-- COMMAND``): the most common gap
    between the steps of its scheduled saves, as its journal shows them."""
    steps = sorted({s for e in events if e["event"] == "checkpoint_saved" and not e.get("copy")
                    and e.get("reason") in (None, "interval")
                    and isinstance(s := e.get("step"), int)})
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return statistics.mode(gaps) if gaps else None


def checkpoint_hint(tl: Timeline, acc: Accounting) -> dict[str, Any] | None:
    # A supervisor that died while no rank ran lost no step: no checkpoint interval helps.
    failures = [i for i in acc.incidents
                if i.attempt is not None and i.attempt.outcome != "stopped"]
    saves = [b for e in tl.events if e["event"] == "checkpoint_saved" and not e.get("copy")
             and (b := number(e.get("blocking_seconds"))) is not None and b > 0]
    if not failures or not saves or not acc.typical_step_seconds:
        return None
    save = statistics.median(saves)
    mtbf = acc.wall_seconds / len(failures)
    interval = young_daly_interval(save, mtbf)
    return {
        "current_every_steps": (tl.config("checkpoint", "every_steps")
                                or _observed_every_steps(tl.events)),
        "suggested_every_steps": max(1, round(interval / acc.typical_step_seconds)),
        "failures": len(failures),
        "mtbf_seconds": mtbf,
        "save_blocking_seconds": save,
        "mean_steps_lost_per_failure": statistics.mean(len(i.lost_steps) for i in failures),
        "basis": (f"Young/Daly: sqrt(2 x {save:.3g} s blocking per save x {mtbf:.3g} s "
                  f"between failures), from {len(failures)} failure(s) in this run: "
                  "a rough estimate"),
    }
