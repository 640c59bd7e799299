"""Rule: replicas that diverged, all-reduce checksums that mismatched (diagnose/corruption.py)."""

from __future__ import annotations

from trainwatch.diagnose import corruption
from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Finding


def check_silent_corruption(a: Analysis) -> list[Finding]:
    return corruption.check(a.ev)
