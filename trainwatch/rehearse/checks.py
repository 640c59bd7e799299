"""A rehearsal's verdicts: PASS / WARN / FAIL (or SKIP, saying why) with a reason each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ORDER = {"FAIL": 3, "WARN": 2, "PASS": 1, "SKIP": 0}


@dataclass
class Check:
    id: str
    status: str  # PASS | WARN | FAIL | SKIP
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status, "reason": self.reason,
                "evidence": self.evidence}


def overall(checks: list[Check]) -> str:
    worst = max((ORDER[c.status] for c in checks), default=1)
    return {3: "FAIL", 2: "WARN"}.get(worst, "PASS")
