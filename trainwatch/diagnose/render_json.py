"""The machine-readable report (``--json``), format ``trainwatch.diagnose`` version 1."""

from __future__ import annotations

import json
from typing import Any

from trainwatch.diagnose.model import Evidence, Finding
from trainwatch.redact import redact

REPORT_FORMAT = "trainwatch.diagnose"


def report(ev: Evidence, findings: list[Finding], exit_code: int) -> dict[str, Any]:
    return redact({
        "format": REPORT_FORMAT, "version": 1,
        "verdict": "healthy" if exit_code == 0 else "problem", "exit_code": exit_code,
        "findings": [f.to_dict() for f in findings],
        "could_not_see": ev.unseen, "skipped": ev.skipped,
        "evidence": ev.to_dict(),
    })


def render(ev: Evidence, findings: list[Finding], exit_code: int) -> str:
    # Compact: json's C encoder only runs without indent (seconds saved at 1,000 ranks).
    return json.dumps(report(ev, findings, exit_code), separators=(",", ":"), default=str)
