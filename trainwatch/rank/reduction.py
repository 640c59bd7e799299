"""Reduction checksums: a gradient checksum carried through DDP's all-reduce, to catch a
reduction that went wrong on some GPU or link (docs/sdc.md).

Replica digests (``replicas.py``) cannot see a wrong all-reduce: every replica applies the
same wrong gradient and the digests agree. The checksum can: on a checked step, DDP's
communication hook sums each bucket's local gradient in float64 (``s_r``) before it is
sent, with its absolute sum (``a_r``) for the rounding tolerance, and all-reduces the two
scalars beside the bucket (16 bytes a rank). After the all-reduce the reduced bucket
(DDP's mean) must sum to ``Σ s_r / world`` within the rounding the reduction may do:
``eps(dtype) · Σ a_r``, twice the worst case of dividing each element by the world size
and summing ``world`` of them in the bucket's dtype (at most ``world`` roundings of
``eps / 2`` each, each relative to at most ``Σ_r |x_r| / world``), plus the float64
summations' own. A flipped exponent or high mantissa bit of one element in transit
changes the sum by far more; a flip in the low mantissa bits stays under it.

Unchecked steps (49 of 50 at the default) do what DDP's own path does and no more, from as
little Python as can be: the process group's all-reduce called directly (not through
``dist.all_reduce``'s Python wrapper), the mean taken by the collective itself
(``ReduceOp.AVG`` on gloo and NCCL, the division inside their reduction, off the loop's
thread and the training stream; no division at all on one rank, where it is the identity;
torch's pre-division otherwise, and for float16, whose sum could overflow), and one small
callback that hands DDP the reduced tensor. Checked steps keep torch's ``allreduce_hook``
(divide, then sum), the reduction the tolerance above is derived for. The
comparison's inputs stay on the device as one float64 tensor per bucket, read by the
telemetry's background thread (no host/device sync in the loop).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import collections
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from trainwatch.errors import ConfigError
from trainwatch.rank.config import TelemetryConfig

# The reference trainer's default (``telemetry.reduction_every``); its measured overhead
# is in docs/sdc.md (benchmarks/reduction_checksum.py).
DEFAULT_EVERY = TelemetryConfig.reduction_every
KEEP = 8  # mismatches a status lists
PENDING = 1024  # checked buckets held for the background thread (bounded)
_EPS64 = torch.finfo(torch.float64).eps
API = "Telemetry.check_reduction"

# Fault injection's view of a bucket about to be sent: (step, bucket index, its buffer).
Tamper = Callable[[int, int, torch.Tensor], None]


@dataclass(frozen=True)
class Verdict:
    """One checked bucket: the reduced bucket's float64 sum against the ranks' local sums."""

    step: int
    bucket: int
    reduced: float
    expected: float
    tolerance: float

    @property
    def mismatch(self) -> bool:
        """Outside the tolerance (a NaN reduced sum is outside it). A non-finite local sum
        (a NaN gradient, which the non-finite guard catches) is nothing to compare."""
        return math.isfinite(self.expected) and not abs(self.reduced - self.expected) <= \
            self.tolerance

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "bucket": self.bucket, "reduced_sum": _json(self.reduced),
                "expected_sum": _json(self.expected), "tolerance": self.tolerance}


def verdict(step: int, bucket: int, values: list[float], *, elements: int, eps: float,
            world: int) -> Verdict:
    """From ``[reduced sum, Σ s_r, Σ a_r]`` (what the hook kept) for a bucket of
    ``elements`` values of a dtype with machine epsilon ``eps`` reduced over ``world``."""
    reduced, sums, abs_sums = values
    tolerance = (eps + 2 * elements * _EPS64) * abs_sums
    return Verdict(step, bucket, reduced, sums / world, tolerance)


class ReductionCheck:
    """``Telemetry.check_reduction``: DDP's comm hook with a checksum every ``every``
    steps, and the checked buckets not yet read (the hook appends, the background thread
    reads)."""

    def __init__(self, ddp: torch.nn.Module, every: int, step_of: Callable[[], int | None]):
        if int(every) < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise ConfigError(
                f"needs the DistributedDataParallel model (got {type(ddp).__name__}): the "
                "checksum rides on DDP's gradient all-reduce", key=API)
        if ddp._comm_hooks:
            raise _has_hook(ddp._comm_hooks[0][0])
        self.every = int(every)
        self.step_of = step_of
        self.tamper: Tamper | None = None  # fault injection (TRAINWATCH_FAULT=reduce:...)
        self.taken: collections.deque = collections.deque(maxlen=PENDING)
        self.dropped = 0  # checked buckets the deque let go unread (the reader fell behind)
        self._means: dict[torch.dtype, tuple[Any, Any, int]] = {}  # by bucket dtype: _plain
        # The usual model, one dtype whose mean needs no division: its all-reduce bound
        # once, so an unchecked bucket costs the hook, that call and ``_first``.
        self._send = _bound_mean(ddp)
        try:
            ddp.register_comm_hook(ddp.process_group, self.hook)
        except RuntimeError as exc:  # a built-in hook (register_builtin_comm_hook) is there
            ddp._comm_hooks.pop()
            raise _has_hook(None) from exc

    def hook(self, group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        step = self.step_of()
        buffer = bucket.buffer()
        if step is None or (step + 1) % self.every:  # not a checked step: DDP's default
            if self.tamper is not None and step is not None:
                self.tamper(step, bucket.index(), buffer)
            send = self._send
            if send is not None and buffer.dtype is send[2]:
                return send[0]([buffer], send[1]).get_future().then(_first)
            return self._plain(group, buffer)
        tamper = self.tamper
        world = (group if group is not None else dist.group.WORLD).size()
        # The abs-sum only scales the tolerance: float32 is exact enough (relative error
        # ~1e-5) and a float64 one cost three times the float64 sum on a CPU.
        local = torch.stack([buffer.sum(dtype=torch.float64),
                             buffer.abs().sum(dtype=torch.float32).double()])
        sums = dist.all_reduce(local, group=group, async_op=True).get_future()
        if tamper is not None:  # after the local checksum: a fault in transit
            tamper(step, bucket.index(), buffer)
        index, elements = bucket.index(), buffer.numel()
        eps = torch.finfo(buffer.dtype).eps

        def check(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            reduced = fut.value()
            totals = sums.wait()[0]
            values = torch.cat([reduced.sum(dtype=torch.float64).reshape(1), totals])
            if len(self.taken) == PENDING:
                self.dropped += 1
            self.taken.append((step, index, elements, eps, world, values, _event_after(values)))
            return reduced

        return allreduce_hook(group, bucket).then(check)

    def _plain(self, group: Any, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The bucket's mean over the ranks, as DDP's default path makes it, at the least
        cost a step (how: ``_mean_of``, chosen once; DDP passes its one group every time)."""
        mean = self._means.get(buffer.dtype)
        if mean is None:
            mean = self._means[buffer.dtype] = _mean_of(group, buffer.dtype)
        pg, options, divide = mean
        if divide != 1:
            buffer.div_(divide)
        return pg.allreduce([buffer], options).get_future().then(_first)

    def resolve(self) -> list[Verdict]:
        """The buckets checked since the last call (reads the device)."""
        out = []
        for _ in range(len(self.taken)):
            step, index, elements, eps, world, values, done = self.taken.popleft()
            if done is not None:
                done.synchronize()  # blocks this (the background) thread only
            out.append(verdict(step, index, values.tolist(), elements=elements, eps=eps,
                               world=world))
        return out


def _mean_of(group: Any, dtype: torch.dtype) -> tuple[Any, Any, int]:
    """``(process group, all-reduce options, divide by)`` for a bucket's mean: the sum
    alone on one rank; ``ReduceOp.AVG`` where the backend averages in its reduction (gloo,
    NCCL) and the sum of undivided float16 values cannot overflow; else divide, then sum."""
    pg = group if group is not None else dist.group.WORLD
    world, options = pg.size(), dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    if world == 1:
        return pg, options, 1
    if dtype != torch.float16 and dist.get_backend(pg) in ("gloo", "nccl"):
        options.reduceOp = dist.ReduceOp.AVG
        return pg, options, 1
    return pg, options, world


def _bound_mean(ddp: Any) -> tuple[Any, Any, torch.dtype] | None:
    """``(the group's all-reduce, its options, the dtype)`` where every gradient DDP reduces
    has one dtype whose mean ``_mean_of`` takes without a division; else None."""
    dtypes = {p.dtype for p in ddp.module.parameters() if p.requires_grad}
    if len(dtypes) != 1 or getattr(ddp, "mixed_precision", None) is not None:
        return None
    dtype = dtypes.pop()
    pg, options, divide = _mean_of(ddp.process_group, dtype)
    return (pg.allreduce, options, dtype) if divide == 1 else None


def _first(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    """An all-reduce's future holds its list of tensors; DDP wants the tensor."""
    return fut.value()[0]


def _event_after(values: torch.Tensor) -> Any:
    """On a GPU, an event after the work that made ``values``: a future's callback runs on a
    stream of its own, which a read from another thread's stream would not wait for."""
    if values.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(values.device))
    return event


def _has_hook(hook: Any) -> ConfigError:
    name = getattr(hook, "__qualname__", None) or "a built-in one"
    return ConfigError(
        f"the model already has a DDP communication hook ({name}); DDP allows one, so the "
        "reduction checksum cannot ride on it: leave check_reduction off for this model",
        key=API)


def _json(value: float) -> float | str:
    """A float JSON can hold (NaN and Inf as their names)."""
    return value if math.isfinite(value) else str(value)
