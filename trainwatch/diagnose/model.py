"""What diagnose gathers (``Evidence``) and what it concludes (``Finding``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trainwatch.contract.alerts import SEVERITIES

# Finding categories, in the order a tired reader should act on them.
CATEGORIES = (
    "rank_dead", "rank_stuck", "node", "collective_desync", "storage", "gpu_fault", "network",
    "checkpoint", "nonfinite_loss", "replica_divergence", "reduction_mismatch", "straggler",
    "stalled", "alerts", "healthy",
)
CONFIDENCES = ("high", "medium", "low")


@dataclass
class Finding:
    """One conclusion, with the evidence lines that support it and what to do next."""

    category: str
    title: str
    severity: str = "critical"
    confidence: str = "high"
    ranks: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    runbook: str | None = None
    next_command: str | None = None
    stack: list[str] = field(default_factory=list)
    cause: dict[str, Any] | None = None   # what the culprit waits for (diagnose/causes.py)

    def sort_key(self) -> tuple[int, int, int]:
        return (SEVERITIES.index(self.severity), CONFIDENCES.index(self.confidence),
                CATEGORIES.index(self.category))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Evidence:
    """Everything gathered, as plain JSON-able data (it goes into --json and --bundle)."""

    run_dir: str
    collected_at: float
    host: str
    run: dict[str, Any] | None = None
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    launcher: dict[str, Any] = field(default_factory=dict)
    dumps: dict[int, dict[str, Any]] = field(default_factory=dict)
    # what diagnostics/ kept of dead ranks (diagnose/saved_evidence.py): the post-mortem's
    saved: dict[str, Any] = field(default_factory=dict)
    stacks: dict[int, dict[str, Any]] = field(default_factory=dict)
    collectives: dict[str, Any] = field(default_factory=dict)
    journal: dict[str, Any] = field(default_factory=dict)
    supervisor: dict[str, Any] = field(default_factory=dict)  # diagnose/supervisor.py
    checkpoints: dict[str, Any] = field(default_factory=dict)
    agents: list[dict[str, Any]] = field(default_factory=list)
    node_cpu: dict[str, Any] = field(default_factory=dict)  # diagnose/node_cpu.py
    node_network: dict[str, Any] = field(default_factory=dict)  # diagnose/node_network.py
    prometheus: dict[str, Any] | None = None
    unseen: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # rank -> the world size it ran at: ranks of an earlier attempt that the newest one,
    # resumed at a smaller world size, no longer has (their statuses are left behind)
    former_ranks: dict[int, int] = field(default_factory=dict)

    def cannot_see(self, what: str) -> None:
        """Record something diagnose could not observe (shown instead of a guess)."""
        if what not in self.unseen:
            self.unseen.append(what)

    def to_dict(self) -> dict[str, Any]:
        # Shallow: the values are already plain JSON-like data, and a deep copy of a
        # thousand ranks' evidence costs seconds (redaction copies it anyway).
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("ranks", "dumps", "stacks", "former_ranks"):
            data[key] = {str(k): v for k, v in data[key].items()}
        return data


def step_label(view: dict[str, Any]) -> str:
    """A rank's step with what it means: the step it is in (or last started), then how many
    it completed (a checkpoint's and the report's step count): "29 (30 completed)"."""
    done = view.get("steps_completed")
    return f"{view.get('step')}" + (f" ({done} completed)" if done is not None else "")
