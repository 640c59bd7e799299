"""Detect a NaN/Inf loss or gradient norm without reading it on the host, and NaN/Inf in
state about to be saved.

The flag stays a tensor on the loss's device; the checkpointer sums it across ranks in
the one small all_reduce it does per step, so a bad value on any rank is seen by all.
The state check runs on the host copy a save already made (the writer's thread in async
mode), never on the device.
"""

from __future__ import annotations

from typing import Any

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


def nonfinite_state(tree: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in ``tree`` holding a NaN or Inf."""
    found: list[str] = []
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and not _finite(tree):
            found.append(prefix or "tensor")
    elif isinstance(tree, dict):
        for key, value in tree.items():
            found += nonfinite_state(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            found += nonfinite_state(value, f"{prefix}.{i}" if prefix else str(i))
    return found


def _finite(tensor: torch.Tensor) -> bool:
    """One reduction pass, nothing allocated: a NaN makes both ends NaN, an Inf shows at one.

    ``isfinite(t).all()`` writes a bool per element and reads it back, which took several
    times longer than writing the checkpoint itself on a busy host.
    """
    if tensor.numel() == 0:
        return True
    try:
        low, high = torch.aminmax(tensor.detach())
    except (RuntimeError, NotImplementedError):  # dtypes without min/max (float8 on CPU)
        return bool(torch.isfinite(tensor.float()).all())  # nor isfinite: a float32 copy
    return bool(torch.isfinite(low) and torch.isfinite(high))
