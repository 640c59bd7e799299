"""Steps whose data a rollback asked to drop: ``RUN_DIR/control/skip-steps.json``.

When a NaN or a loss spike rolls a job back (control/actions.py, ``rollback_skip``), the
controller writes ``{"from_step": A, "to_step": B, "reason": ...}`` and restarts the job
from the last checkpoint before the bad step. Steps A..B (inclusive) are then never
trained: their batches are read and dropped, on every rank alike, so the data order of
the rest of the run is exactly the one it would have had, and a later resume (from a
checkpoint before, inside or after the window) drops the same batches again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir


class Batches(Protocol):
    """What a window's batches are dropped from: an iterator that tells its position
    (the reference trainer's ``ShardedBatches``)."""

    def __next__(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...


@dataclass
class SkipSteps:
    """The window of steps to drop (empty when no rollback asked for one)."""

    first: int = 0
    last: int = -1
    reason: str | None = None
    dropped: list[int] = field(default_factory=list)
    _start: dict[str, Any] | None = None

    def __contains__(self, step: int) -> bool:
        return self.first <= step <= self.last

    def drop(self, step: int, loader: Batches, batches: int, *, final: bool
             ) -> dict[str, Any] | None:
        """Read and discard ``step``'s ``batches``; after the window's last step (or the
        run's), the ``data_skipped`` journal fields: steps, batches and data positions."""
        if not self.dropped:
            self._start = loader.state_dict()
        for _ in range(batches):
            next(loader)
        self.dropped.append(step)
        if step != self.last and not final:
            return None
        assert self._start is not None, "taken when the window's first step was dropped"
        return {"steps": list(self.dropped), "batches_per_rank": len(self.dropped) * batches,
                "data_from": _position(self._start), "data_to": _position(loader.state_dict()),
                "reason": self.reason}


def _position(state: dict[str, Any]) -> dict[str, Any]:
    return {"epoch": state["epoch"], "position": state["position"]}


def read_skip_steps(run: RunDir) -> SkipSteps:
    """The window in ``control/skip-steps.json``; a file that is not one is bad input."""
    path = run.skip_steps_file
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return SkipSteps()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the rollback's skip request: {exc}",
                          file=str(path)) from None
    if not isinstance(doc, dict):
        raise ConfigError("must be a JSON object {from_step, to_step}", file=str(path))
    for key in ("from_step", "to_step"):
        value = doc.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"must be a step number >= 0, got {value!r}", file=str(path),
                              key=key)
    reason = doc.get("reason")
    return SkipSteps(doc["from_step"], doc["to_step"], reason if isinstance(reason, str) else None)


def skip_steps_message(run: RunDir) -> Any:
    """What rank 0 tells the other ranks of the skip request: the window, or its error."""
    try:
        window = read_skip_steps(run)
        return (window.first, window.last, window.reason)
    except ConfigError as exc:
        return exc


def skip_steps_from(message: Any) -> SkipSteps:
    """The window rank 0's ``skip_steps_message`` names; its ConfigError raised here."""
    if isinstance(message, ConfigError):
        raise message
    return SkipSteps(*message)


def agree_skip_steps(run: RunDir, distributed: bool) -> SkipSteps:
    """Rank 0 reads the request and every rank gets the same window (or the same error)."""
    if not distributed:
        return read_skip_steps(run)
    box: list[Any] = [skip_steps_message(run) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return skip_steps_from(box[0])
