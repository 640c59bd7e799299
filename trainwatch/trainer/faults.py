"""Fault injection for tests and drills, driven by the ``TRAINWATCH_FAULT`` variable.

    TRAINWATCH_FAULT="exit:rank=1:step=5"              rank 1 exits with code 1 at step 5
    TRAINWATCH_FAULT="exit:rank=1:step=5:code=3"       ... with exit code 3
    TRAINWATCH_FAULT="kill:rank=0:step=8"              rank 0 SIGKILLs itself (like the OOM killer)
    TRAINWATCH_FAULT="sleep:rank=1:step=5:seconds=30"  rank 1 stalls 30 s, then carries on
    TRAINWATCH_FAULT="hang:rank=1:step=5"              rank 1 stops progressing (heartbeats go on)
    TRAINWATCH_FAULT="freeze:rank=1:step=5"            rank 1 SIGSTOPs itself (heartbeats stop too)
    TRAINWATCH_FAULT="slow:rank=1:factor=1.25"         rank 1 computes 1.25x slower (a straggler)
    TRAINWATCH_FAULT="slow:factor=2:step=10:until=60"  every rank is 2x slower in steps 10-59
    TRAINWATCH_FAULT="nan:rank=1:step=23"              rank 1's loss at step 23 is NaN (a bad batch)
    TRAINWATCH_FAULT="slow:delay=0.25"                 every step takes 0.25 s longer (pacing)
    TRAINWATCH_FAULT="sdc:rank=1:step=40"              after step 40's optimizer step, rank 1
                                                       flips bit 20 (``bit=B``) of one weight:
                                                       silent data corruption (docs/sdc.md)
    TRAINWATCH_FAULT="reduce:rank=1:step=29"           in step 29's gradient all-reduce, rank 1's
                                                       contribution to one bucket has an exponent
                                                       bit (``bit=B``) of its largest element
                                                       flipped in transit, after its checksum
                                                       was taken: a bad link or reduction
                                                       (docs/sdc.md)
    TRAINWATCH_FAULT="eval:rank=0:step=30:seconds=90"  after step 30 rank 0 alone evaluates for
                                                       90 s (the others wait in the next
                                                       collective); no seconds: it hangs there

Several faults are separated by commas. ``rank`` may be omitted (every rank).
One-shot faults (all but ``slow``) fire on the first attempt only, i.e. when the
job's restart count is 0 (torchrun's TORCHELASTIC_RESTART_COUNT; the trainer passes the
largest over the nodes), so a restarted job runs clean; add
``attempt=N`` to fire on attempt N, or ``attempt=any``. ``slow`` applies on every
attempt unless ``attempt`` is given. ``launch=N`` limits a fault to the N-th start of
the job by a job controller (``trainwatch run``, the webhook receiver), which sets
TRAINWATCH_LAUNCH; without a controller the launch is 1. Drills use ``launch=1`` so
that the job the controller restarts runs clean, as after a transient failure.
Faults fire inside the forward phase, where a slow or stuck accelerator would show;
``nan`` multiplies the step's loss by NaN right after the forward
(``FaultInjector.loss``), so backward, the gradient norm and the non-finite guard all
see it. A job a controller restarts (``trainwatch run``) is
a new torchrun, attempt 0 again: there ``nan`` fires again whenever step S runs, like
a corrupt batch, until the step's data is skipped. ``sdc`` flips the bit right after the
optimizer step (``FaultInjector.corrupt``), in the first element of the model's first
parameter, as a GPU that computed one value wrong would leave it: no error, and the
replicas' weights differ from then on. ``reduce`` flips the bit inside the reduction
check's DDP hook (``FaultInjector.reduce``; the trainer needs
``telemetry.reduction_every`` > 0): every replica receives the same wrong gradient, so
their digests agree, and only a checked step's checksum can see it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from trainwatch.contract.env import FAULT_ENV, LAUNCH_ENV
from trainwatch.errors import ConfigError

if TYPE_CHECKING:  # the launcher parses faults before torchrun starts: no torch import there
    import torch

ONE_SHOT = ("exit", "kill", "sleep", "hang", "freeze", "nan", "eval", "sdc", "reduce")
KINDS = ONE_SHOT + ("slow",)
# Extra keys each kind takes, with their types.
_PARAMS: dict[str, dict[str, type[int] | type[float]]] = {
    "exit": {"code": int}, "kill": {}, "sleep": {"seconds": float}, "hang": {}, "freeze": {},
    "nan": {}, "slow": {"factor": float, "until": int, "delay": float},
    "eval": {"seconds": float}, "sdc": {"bit": int}, "reduce": {"bit": int}}
# One-shot faults fired outside the forward, by the method of their name.
_FIRED_ELSEWHERE = ("nan", "eval", "sdc", "reduce")
SDC_BIT = 20  # sdc: a float32's value by ~12 %
# reduce: this many bits below the top, an exponent bit of float32, bf16 and fp16 (bit 27,
# 11, 11): the value is scaled by 2^16 (float32, bf16) or 4 (fp16), or divided by it.
REDUCE_BIT_FROM_TOP = 5
# A backward pass costs about twice the forward: a straggler's whole step is ~3x forward.
_STEP_PER_FORWARD = 3.0


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    attempt: int | None = 0  # None: any attempt
    launch: int | None = None  # None: any start of the job by a controller
    code: int = 1
    seconds: float = 0.0
    factor: float = 1.0
    until: int | None = None  # slow: first step that runs at full speed again
    delay: float = 0.0  # slow: seconds added to every step (pacing a drill or test)
    bit: int | None = None  # sdc, reduce: which bit to flip (default SDC_BIT, REDUCE_BIT_FROM_TOP)

    def slows(self, step: int) -> bool:
        """For ``slow``: whether ``step`` is in its window [step, until)."""
        return ((self.step is None or step >= self.step)
                and (self.until is None or step < self.until))

    def applies(self, rank: int, attempt: int, launch: int = 1) -> bool:
        return ((self.rank is None or self.rank == rank)
                and (self.attempt is None or self.attempt == attempt)
                and (self.launch is None or self.launch == launch))


def parse_faults(text: str) -> list[Fault]:
    """Parse a TRAINWATCH_FAULT value; a bad one is a ConfigError naming the variable."""
    faults = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        kind, *pairs = spec.split(":")
        if kind not in KINDS:
            raise ConfigError(f"unknown fault kind '{kind}' (known: {', '.join(KINDS)})",
                              file=FAULT_ENV, key=spec)
        attempt: int | None = 0 if kind in ONE_SHOT else None
        ints: dict[str, int] = {}
        floats: dict[str, float] = {}
        types = {"rank": int, "step": int, "attempt": int, "launch": int, **_PARAMS[kind]}
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if not sep or key not in types:
                raise ConfigError(f"'{pair}' is not one of {', '.join(k + '=' for k in types)}",
                                  file=FAULT_ENV, key=spec)
            if key == "attempt" and raw == "any":
                attempt = None
                continue
            try:
                value = types[key](raw)
            except ValueError:
                raise ConfigError(f"{key} must be {types[key].__name__}, got '{raw}'",
                                  file=FAULT_ENV, key=spec) from None
            if key == "attempt":
                attempt = int(value)
            elif isinstance(value, int):
                ints[key] = value
            else:
                floats[key] = value
        launch, step, until = ints.get("launch"), ints.get("step"), ints.get("until")
        if launch is not None and launch < 1:
            raise ConfigError("launch must be >= 1 (the first start is 1)", file=FAULT_ENV, key=spec)
        if kind in ONE_SHOT and step is None:
            raise ConfigError("needs step=N", file=FAULT_ENV, key=spec)
        if kind == "sleep" and not floats.get("seconds", 0) > 0:
            raise ConfigError("needs seconds=S > 0", file=FAULT_ENV, key=spec)
        if kind == "slow" and not (floats.get("factor", 0) > 1 or floats.get("delay", 0) > 0):
            raise ConfigError("needs factor=F > 1 or delay=S > 0", file=FAULT_ENV, key=spec)
        if kind == "eval" and "seconds" in floats and not floats["seconds"] > 0:
            raise ConfigError("seconds=S must be > 0 (leave it out to hang)", file=FAULT_ENV,
                              key=spec)
        if kind in ("sdc", "reduce") and not 0 <= ints.get("bit", 0) < 32:
            raise ConfigError("bit=B must be 0-31", file=FAULT_ENV, key=spec)
        if kind == "eval" and "seconds" not in floats:
            floats["seconds"] = math.inf
        start = step or 0
        if until is not None and until <= start:
            raise ConfigError(f"until={until} must be after step={start}", file=FAULT_ENV, key=spec)
        faults.append(Fault(kind, attempt=attempt, **ints,
                            seconds=floats.get("seconds", Fault.seconds),
                            factor=floats.get("factor", Fault.factor),
                            delay=floats.get("delay", Fault.delay)))
    return faults


class FaultInjector:
    """The faults that apply to this rank and attempt; ``forward(step)`` wraps the forward."""

    def __init__(self, faults: list[Fault], *, rank: int, attempt: int, launch: int = 1,
                 on_fire: Callable[[Fault, int], None] | None = None):
        self.faults = [f for f in faults if f.applies(rank, attempt, launch)]
        self.on_fire = on_fire  # e.g. a journal event, so drills can see what was injected
        self._fired: set[Fault] = set()

    @classmethod
    def from_env(cls, rank: int, on_fire: Callable[[Fault, int], None] | None = None,
                 attempt: int | None = None) -> "FaultInjector":
        """``attempt`` defaults to torchrun's restart count (per node; the trainer passes
        the job's)."""
        if attempt is None:
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        launch = int(os.environ.get(LAUNCH_ENV, "1") or 1)
        return cls(parse_faults(os.environ.get(FAULT_ENV, "")), rank=rank, attempt=attempt,
                   launch=launch, on_fire=on_fire)

    @contextlib.contextmanager
    def forward(self, step: int) -> Iterator[None]:
        if not self.faults:
            yield
            return
        for fault in self.faults:
            if fault.kind in ONE_SHOT and fault.kind not in _FIRED_ELSEWHERE \
                    and self._due(fault, step):
                self._fire(fault, step)
        started = time.perf_counter()
        yield
        elapsed = time.perf_counter() - started
        for fault in self.faults:
            if fault.kind == "slow" and fault.slows(step):
                if fault not in self._fired:  # journal the first slowed step, once
                    self._fired.add(fault)
                    if self.on_fire is not None:
                        self.on_fire(fault, step)
                time.sleep((fault.factor - 1.0) * _STEP_PER_FORWARD * elapsed + fault.delay)

    def evaluation(self, step: int) -> float | None:
        """Seconds of a rank-alone evaluation due after ``step`` (inf: it hangs), or None.

        Like loops that evaluate or save on rank 0 only while the other ranks go on to the
        next collective and wait there; the trainer runs it in the ``eval`` phase.
        """
        for fault in self.faults:
            if fault.kind == "eval" and self._due(fault, step):
                print(f"trainwatch: injecting fault eval ({fault.seconds:g} s, this rank "
                      f"alone) after step {step} (pid {os.getpid()})", file=sys.stderr,
                      flush=True)
                return fault.seconds
        return None

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, made NaN when a ``nan`` fault is due at ``step`` (once per process)."""
        for fault in self.faults:
            if fault.kind == "nan" and self._due(fault, step):
                self._fire(fault, step)
                return loss * float("nan")
        return loss

    def corrupt(self, step: int, model: torch.nn.Module) -> None:
        """Flip one bit of one weight when an ``sdc`` fault is due after ``step``'s update."""
        for fault in self.faults:
            if fault.kind == "sdc" and self._due(fault, step):
                param = next(model.parameters()).data  # .data: no autograd to tell
                if hasattr(param, "to_local"):  # a DTensor (parallel.mode fsdp): this shard
                    param = param.to_local()
                bit = SDC_BIT if fault.bit is None else fault.bit
                _flip(param.view(-1), 0, bit)
                print(f"trainwatch: injecting fault sdc (bit {bit} of a weight) after "
                      f"step {step} (pid {os.getpid()})", file=sys.stderr, flush=True)

    @property
    def reduces(self) -> bool:
        """Whether a ``reduce`` fault applies here (the trainer hands ``reduce`` to the
        reduction check)."""
        return any(f.kind == "reduce" for f in self.faults)

    def reduce(self, step: int, bucket: int, buffer: torch.Tensor) -> None:
        """Flip a high bit of the largest element of a gradient bucket about to be
        all-reduced when a ``reduce`` fault is due at ``step`` (the first bucket sent)."""
        for fault in self.faults:
            if fault.kind == "reduce" and self._due(fault, step):
                index = int(buffer.abs().argmax())
                width = 8 * buffer.element_size()
                bit = width - REDUCE_BIT_FROM_TOP if fault.bit is None else fault.bit
                before = float(buffer[index])
                _flip(buffer, index, bit)
                print(f"trainwatch: injecting fault reduce (bit {bit} of gradient element "
                      f"{index} of bucket {bucket}: {before:g} -> {float(buffer[index]):g}) "
                      f"in step {step}'s all-reduce (pid {os.getpid()})", file=sys.stderr,
                      flush=True)

    def _due(self, fault: Fault, step: int) -> bool:
        """True the first time ``step`` reaches a one-shot fault; journals it (on_fire)."""
        if fault.step != step or fault in self._fired:
            return False
        self._fired.add(fault)
        if self.on_fire is not None:
            self.on_fire(fault, step)
        return True

    @staticmethod
    def _fire(fault: Fault, step: int) -> None:
        print(f"trainwatch: injecting fault {fault.kind} at step {step} "
              f"(pid {os.getpid()})", file=sys.stderr, flush=True)
        if fault.kind == "exit":
            os._exit(fault.code)  # no cleanup, like a crash
        elif fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "sleep":
            time.sleep(fault.seconds)
        elif fault.kind == "hang":
            while True:
                time.sleep(3600)


def _flip(flat: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` (capped at the top one) of element ``index`` of a 1-d float tensor."""
    import torch
    width = 8 * flat.element_size()
    ints = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    bit = min(bit, width - 1)
    mask = (1 << bit) - ((1 << width) if bit == width - 1 else 0)  # two's complement
    flat.view(ints)[index] ^= torch.tensor(mask, dtype=ints)
