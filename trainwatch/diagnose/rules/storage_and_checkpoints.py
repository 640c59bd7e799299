"""Rule: checkpoint storage full, and checkpoint saves failing."""

from __future__ import annotations

from typing import Any

from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Finding

LOW_FREE_RATIO = 0.02


def check_storage_and_checkpoints(a: Analysis) -> list[Finding]:
    info = a.ev.checkpoints or {}
    findings = []
    disk = info.get("disk") or {}
    errors = [str(f.get("error") or "") for f in info.get("failures", [])]
    enospc = any("No space left" in e or "ENOSPC" in e or "Errno 28" in e for e in errors)
    free_ratio = disk.get("free_ratio")
    if enospc or (free_ratio is not None and free_ratio < LOW_FREE_RATIO):
        findings.append(Finding(
            "storage", f"checkpoint storage is full ({disk.get('path')})",
            evidence=[f"{disk.get('path')}: {disk.get('free_bytes')} bytes free of "
                      f"{disk.get('total_bytes')} ({_pct(free_ratio)})"]
            + [f"checkpoint save failed: {e}" for e in errors if e][:3],
            runbook="StorageFull", next_command=f"df -h {disk.get('path')}; du -sh "
                                                f"{info.get('dir')}/*"))
    if info.get("failures"):
        newest = info.get("newest")
        count = sum(_count(f) for f in info["failures"])
        evidence = [f"{count} failed checkpoint save(s); last: "
                    f"step {info['failures'][-1].get('step')}: {errors[-1] or 'no reason given'}",
                    "newest checkpoint: " + (_ckpt_text(newest) if newest
                                             else info.get("newest_text", "unknown"))]
        findings.append(Finding(
            "checkpoint", "checkpoint saves are failing", evidence=evidence,
            ranks=sorted({f["rank"] for f in info["failures"] if isinstance(f.get("rank"), int)}),
            runbook="CheckpointFailed",
            next_command=f"trainwatch checkpoint list {info.get('dir')}"))
    if not info.get("newest"):
        a.ev.cannot_see("newest verified checkpoint: unknown")
    return findings


def _count(failure: dict[str, Any]) -> int:
    """A journal event is one failure; a rank's status counts its own (``count``)."""
    count = failure.get("count")
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1


def _pct(ratio: float | None) -> str:
    return "?" if ratio is None else f"{ratio * 100:.1f} % free"


def _ckpt_text(c: dict[str, Any]) -> str:
    age = c.get("age_seconds")
    return (f"step {c.get('step')} at {c.get('path')} ({c.get('source')}"
            + (f", {age:.0f} s old)" if isinstance(age, (int, float)) else ")"))
