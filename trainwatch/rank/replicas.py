"""Replica digests: a 64-bit fingerprint of a rank's parameters, to compare across the
data-parallel replicas that must hold the same ones (docs/sdc.md).

A GPU that computes wrong without an error (silent data corruption) leaves its rank's
weights different from the other replicas'; the loss may not show it for thousands of
steps. Each rank digests its parameters every ``every`` steps and publishes the digest
in its status; the agent compares the ranks' digests of the same step.

The digest reads every parameter once and copies none: each tensor's bits are viewed as
an integer tensor of the same width (float32 as int32, bf16/fp16 as int16, float64 as
int64) and summed (integer sums accumulate in int64). The per-tensor sums are combined
with odd weights, ``sum(s_i * (2i + 1))`` with int64 wrap-around: flipping bit k of one
element changes its sum by ±2^k and the digest by ±2^k·(2i+1), which is never 0 modulo
2^64, so any single bit flip anywhere changes the digest. It is computed on the device
as 0-d tensors and read by the telemetry's background thread (no host/device sync in
the loop). With ``tolerance`` the digest also carries the float64 norm, for replicas that
are not bitwise equal (the agent then compares norms, relatively).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from trainwatch.rank.checkpoint.whole_state import is_dtensor
from trainwatch.rank.config import TelemetryConfig

# The reference trainer's default (``telemetry.replica_every``); its measured overhead is
# in docs/sdc.md (benchmarks/replica_digest.py).
DEFAULT_EVERY = TelemetryConfig.replica_every
KEEP = 8  # digests a status lists: the agent compares the newest that every rank has
BITS = (1 << 64) - 1
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensors_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
               ) -> list[torch.Tensor]:
    """The tensors a digest covers, in a fixed order: the parameters, then (with an
    optimizer) each parameter's state tensors by key (Adam's moments, step). A DTensor
    (FSDP2) counts as this rank's own shard: the replicas of a shard (HSDP) hold the same
    one, and digesting the DTensor itself would start collectives behind the loop's back."""
    tensors = list(model.parameters())
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p) or {}
                tensors += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return [t.to_local() if is_dtensor(t) else t for t in tensors]


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s elements read as integers of its width, as an int64 0-d tensor."""
    t = t.detach()
    width = _INT_OF_WIDTH.get(t.element_size())
    if width is None or t.dtype == torch.bool:  # complex128 and the like: as bytes
        return t.contiguous().view(torch.uint8).sum(dtype=torch.int64)
    if t.dtype != width:
        t = t.view(width)
    return t.sum(dtype=torch.int64)


def digest(tensors: Iterable[torch.Tensor], with_norm: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(64-bit digest as an int64 0-d tensor, float64 norm or None), on the first
    tensor's device; nothing is read back to the host here."""
    sums, squares = [], []
    for t in tensors:
        if t.numel() == 0:
            continue
        sums.append(_bit_sum(t))
        if with_norm and t.is_floating_point():
            squares.append(torch.linalg.vector_norm(t.detach(), dtype=torch.float64) ** 2)
    if not sums:
        zero = torch.zeros((), dtype=torch.int64)
        return zero, (zero.double() if with_norm else None)
    device = sums[0].device
    stacked = torch.stack([s.to(device, non_blocking=True) for s in sums])
    weights = torch.arange(1, 2 * len(sums), 2, dtype=torch.int64, device=device)
    bits = (stacked * weights).sum()
    norm = None
    if with_norm:
        norm = (torch.stack([s.to(device, non_blocking=True) for s in squares]).sum().sqrt()
                if squares else torch.zeros((), dtype=torch.float64, device=device))
    return bits, norm


def bits_hex(value: int) -> str:
    """An int64 digest as the 16 hex digits a status carries."""
    return "%016x" % (int(value) & BITS)


@dataclass
class ReplicaCheck:
    """``Telemetry.check_replicas``: what to digest, how often, and the digests taken
    but not yet read (the loop appends, the background thread reads)."""

    model: torch.nn.Module
    every: int = DEFAULT_EVERY
    optimizer: torch.optim.Optimizer | None = None
    tolerance: float | None = None
    group: Any = 0

    def __post_init__(self) -> None:
        if int(self.every) < 1:
            raise ValueError(f"every must be a positive number of steps, got {self.every!r}")
        self.every = int(self.every)
        if self.tolerance is not None and not (math.isfinite(self.tolerance)
                                               and self.tolerance >= 0):
            raise ValueError(f"tolerance must be a number >= 0, got {self.tolerance!r}")
        if not isinstance(self.group, (int, str)) or isinstance(self.group, bool):
            raise ValueError(f"replica_group must be an int or a str, got {self.group!r}")
        self.taken: collections.deque = collections.deque(maxlen=KEEP)

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def take(self, step: int) -> None:
        """Digest now (on the device, asynchronously); read later by ``resolve``."""
        bits, norm = digest(tensors_of(self.model, self.optimizer), self.tolerance is not None)
        self.taken.append((step, bits, norm))

    def resolve(self) -> list[dict[str, Any]]:
        """The digests taken since the last call, as status records (reads the device)."""
        out = []
        for _ in range(len(self.taken)):
            step, bits, norm = self.taken.popleft()
            out.append({"step": step, "group": self.group, "bits": bits_hex(bits.item()),
                        "norm": None if norm is None else float(norm.item()),
                        "tolerance": self.tolerance})
        return out
