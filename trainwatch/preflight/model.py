"""What a preflight check reports, what the command was asked to check, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.errors import EXIT_OK, EXIT_PROBLEM

# ok: fine; warn: worth a look, fails only with --strict; fail: the node is not fit;
# absent: the thing is not on this node (no GPU, no InfiniBand) - reported, never invented;
# skipped: not asked for, or no way to check it here (the message says which).
STATUSES = ("ok", "warn", "fail", "absent", "skipped")
GROUPS = ("gpu", "sdc", "storage", "host", "network", "software")
DOCS = "docs/preflight.md"


@dataclass
class Check:
    id: str
    status: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    doc: str = ""                 # the section of docs/preflight.md that explains this check
    runbook: str | None = None    # `trainwatch runbook NAME` where an alert covers the fault

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown check status {self.status!r}")
        if not self.doc:
            self.doc = f"{DOCS}#{self.group}"

    @property
    def group(self) -> str:
        return self.id.split(".", 1)[0]

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "group": self.group, "status": self.status,
                "message": self.message, "evidence": self.evidence, "doc": self.doc,
                "runbook": self.runbook}


@dataclass
class Request:
    """What this run of preflight was asked about the job that will start here."""

    run_dir: Path | None = None
    checkpoint_dir: Path | None = None
    data_dir: Path | None = None
    checkpoint_bytes: int | None = None
    peers: list[tuple[str, int]] = field(default_factory=list)
    master: tuple[str, int] | None = None
    python: str | None = None      # the job's interpreter; None: the one running preflight
    groups: tuple[str, ...] = GROUPS


def worst(checks: list[Check], strict: bool) -> int:
    """Exit code: 1 if any check failed (or, with ``strict``, warned), else 0."""
    bad = {"fail", "warn"} if strict else {"fail"}
    return EXIT_PROBLEM if any(c.status in bad for c in checks) else EXIT_OK


def counts(checks: list[Check]) -> dict[str, int]:
    return {status: sum(c.status == status for c in checks) for status in STATUSES}
