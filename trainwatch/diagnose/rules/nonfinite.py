"""Rule: NaN or Inf losses, counted by the telemetry or journalled."""

from __future__ import annotations

from trainwatch.diagnose import journal
from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Finding


def check_nonfinite(a: Analysis) -> list[Finding]:
    bad = {r: v for r, v in a.ev.ranks.items()
           if (v.get("counters") or {}).get("nonfinite_loss_total")
           or (v.get("recent") or {}).get("nonfinite_losses")}
    if not bad:
        return []
    evidence = [f"rank {r}: {v['counters'].get('nonfinite_loss_total', 0)} non-finite loss "
                f"step(s); latest loss {v.get('loss')}" for r, v in sorted(bad.items())]
    evidence += [f"journal: step {e.get('step')} {e.get('event')}"
                 for e in journal.recent(a.ev, "nonfinite_detected")[-3:]]
    return [Finding("nonfinite_loss", "the loss is NaN or Inf", severity="warning",
                    ranks=sorted(bad), nodes=sorted({a.node(r) for r in bad}),
                    evidence=evidence, runbook="TrainingLossNonFinite",
                    next_command=f"grep -n -E 'NaN|Infinity' {a.ev.run_dir}/metrics/*.jsonl "
                                 "| head")]
