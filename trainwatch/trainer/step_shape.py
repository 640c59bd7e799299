"""How one optimizer step's samples are split over the ranks, and how the split changes
when a checkpoint resumes at another world size (docs/checkpoints.md, "The reference
trainer at another world size").

A step trains on a global batch of ``batch_size x grad_accum x world_size`` windows and
its gradient is their mean, whatever the split. The global batch decides the weights, so
it stays what the run started with: at another world size each rank takes
``global_batch / world_size`` windows a step, as micro-batches no larger than
``train.batch_size`` (a rank's memory holds what it held), with as few accumulation steps
as that allows. A global batch the new world size does not divide cannot be split
evenly: refused (exit 2). Torch-free: the launcher asks before starting anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainwatch.errors import ConfigError


@dataclass(frozen=True)
class StepShape:
    """Windows per rank per micro-step, micro-steps per optimizer step, ranks."""

    batch_size: int
    grad_accum: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.world_size

    def describe(self) -> str:
        return (f"{self.global_batch} = {self.world_size} rank(s) x {self.grad_accum} "
                f"micro-step(s) x batch {self.batch_size}")


def saved_shape(data: Any, grad_accum: int) -> StepShape | None:
    """The shape a checkpoint's data position (rank 0's ``data``) was written with; None
    when it is not the reference trainer's. Positions written before the shape was
    recorded have no ``grad_accum``: the config's (it is part of the weights' digest)."""
    if not isinstance(data, dict):
        return None
    values = [data.get("batch_size"), data.get("grad_accum", grad_accum), data.get("world_size")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        return None
    return StepShape(*values)


def reshaped(saved: StepShape, world_size: int, max_batch_size: int, *,
             file: str | None = None) -> StepShape:
    """The shape at ``world_size`` that keeps ``saved``'s global batch (``saved`` itself at
    its own world size); ConfigError (exit 2) when the global batch cannot be split."""
    if world_size == saved.world_size:
        return saved
    total = saved.global_batch
    if total % world_size:
        divisors = [n for n in range(1, total + 1) if total % n == 0]
        raise ConfigError(
            f"written at a global batch of {saved.describe()} windows a step; {world_size} "
            f"ranks cannot share {total} evenly, and another global batch would train other "
            f"weights: run with a world size that divides {total} "
            f"({', '.join(map(str, divisors[:12]))}{', ...' if len(divisors) > 12 else ''}), "
            "or start a new run directory", file=file)
    per_rank = total // world_size
    batch = max(n for n in range(1, min(per_rank, max_batch_size) + 1) if per_rank % n == 0)
    return StepShape(batch, per_rank // batch, world_size)


def check_resumable(manifest: dict[str, Any], world_size: int, batch_size: int,
                    grad_accum: int, *, file: str | None = None) -> StepShape | None:
    """The shape a checkpoint resumes with at ``world_size``, or ConfigError (exit 2); None
    when its data position is not the reference trainer's. What ``trainwatch train`` and
    ``trainwatch run`` ask of the newest checkpoint before starting anything."""
    positions = manifest.get("data_position")
    first = positions[0] if isinstance(positions, list) and positions else None
    saved = saved_shape(first, grad_accum)
    return None if saved is None else reshaped(saved, world_size, batch_size, file=file)
