"""Rule: a stall no stronger rule explained (low confidence; says how to see more)."""

from __future__ import annotations

from trainwatch.diagnose.casefile import Analysis, duration
from trainwatch.diagnose.model import Finding


def check_unexplained_stall(a: Analysis) -> list[Finding]:
    if not a.stalled or a.explained & set(a.running):
        return []
    return [Finding(
        "stalled", f"no rank made progress for {duration(a.progress_age)}; the cause is not "
        "identified", confidence="low", ranks=sorted(a.running),
        nodes=sorted({a.node(r) for r in a.running}),
        evidence=[a.where_line(r) for r in sorted(a.running)] + a.waiting_lines([]),
        runbook="TrainingStalled",
        next_command=(f"trainwatch diagnose --run-dir {a.ev.run_dir} --native" if a.groups else
                      f"TORCH_FR_BUFFER_SIZE=2000 in the job's environment, then "
                      f"trainwatch diagnose --run-dir {a.ev.run_dir} --native"))]
