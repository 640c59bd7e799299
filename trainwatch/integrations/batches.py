"""Samples in a framework's batch, read from its first tensor's shape (no device access):
a step's ``samples`` for throughput (samples/s, TrainingThroughputDrop)."""

from __future__ import annotations

from typing import Any

import torch


def batch_size(batch: Any) -> int | None:
    """The first dimension of the first tensor in a (nested) list, tuple or dict batch."""
    first = batch
    while isinstance(first, (list, tuple, dict)) and first:
        first = first[0] if isinstance(first, (list, tuple)) else next(iter(first.values()))
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else None
