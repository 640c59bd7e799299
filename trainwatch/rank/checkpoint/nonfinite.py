"""Detect a NaN/Inf loss or gradient norm without reading it on the host, and NaN/Inf in
state about to be saved.

The flag stays a tensor on the loss's device; the checkpointer sums it across ranks in
the one small all_reduce it does per step, so a bad value on any rank is seen by all.
The state check runs on the host copy a save already made (the writer's thread in async
mode), never on the device.
"""

from __future__ import annotations

from typing import Any, Iterator

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
    """Dotted names of the floating-point tensors in ``tree`` holding a NaN or Inf.

    The tensors of one dtype and device are looked at in one call (``_foreach_norm``: a
    NaN or Inf makes a norm NaN or Inf), so the guard holds Python's GIL once, not once per
    tensor: run beside a save's writer it no longer waits on the writer's Python for every
    tensor. The 1-norm, not the 2-norm: squaring an optimizer's tiny second moments makes
    denormals, 15x slower on x86. A norm that is not finite is confirmed exactly (a norm
    of huge finite values can overflow), so what is reported is exactly the tensors
    holding a NaN or Inf.
    """
    named = list(_floating(tree, prefix))
    groups: dict[tuple[Any, Any], list[int]] = {}
    for index, (_, tensor) in enumerate(named):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    suspects: list[int] = []
    for indices in groups.values():
        suspects += _suspects(indices, [named[i][1] for i in indices])
    return [named[i][0] for i in sorted(suspects) if not _finite(named[i][1])]


def _floating(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and tree.numel():
            yield prefix or "tensor", tree.detach()
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _floating(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _floating(value, f"{prefix}.{i}" if prefix else str(i))


def _suspects(indices: list[int], tensors: list[torch.Tensor]) -> list[int]:
    """Those of ``indices`` whose tensor's norm is not finite (all, where the dtype has no
    norm: float8 on CPU)."""
    try:
        norms = torch.stack(torch._foreach_norm(tensors, 1))
        bad = (~torch.isfinite(norms)).nonzero().flatten().tolist()
    except (RuntimeError, NotImplementedError):
        return indices
    return [indices[i] for i in bad]


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
