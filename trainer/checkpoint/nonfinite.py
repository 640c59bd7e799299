"""Detect a NaN/Inf loss or gradient norm without reading it on the host.

The flag stays a tensor on the loss's device; the checkpointer sums it across ranks in
the one small all_reduce it does per step, so a bad value on any rank is seen by all.
"""

from __future__ import annotations

import torch


class NonFiniteHalt(RuntimeError):
    """Raised on every rank when ``nonfinite: halt`` and a NaN/Inf was seen on any rank."""


def nonfinite_flag(loss: torch.Tensor, grad_norm: torch.Tensor | float | None) -> torch.Tensor:
    """1.0 when the loss or the gradient norm is NaN or Inf, else 0.0 (on the loss's device)."""
    loss = loss.detach()
    bad = ~torch.isfinite(loss).all()
    if grad_norm is not None:
        norm = torch.as_tensor(grad_norm, device=loss.device).detach()
        bad = bad | ~torch.isfinite(norm).all()
    return bad.to(torch.float32)
