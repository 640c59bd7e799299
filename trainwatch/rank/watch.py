"""Step and phase timing by hooks: ``tel.watch(model, optimizer)`` instead of with-blocks.

A plain loop's step is forward (one or more, with gradient accumulation), backward and
an optimizer step. Four hooks find it: the model's forward pre/post hooks and the
optimizer's step pre/post hooks. A step begins at its first forward with gradients on
(forwards under ``no_grad``, e.g. evaluation, are not training), ``backward`` is the time
from the end of a forward to the next forward or the optimizer step (the loss and its
backward pass), and the step ends when ``optimizer.step()`` returns (it is published when
the next one begins, so values recorded just after ``optimizer.step()`` are its own). A ``data`` phase the
loop still times with ``tel.phase("data")`` just before the step is counted in it.

Each hook costs what a with-block boundary costs (one clock read, a few stores, no lock);
on a GPU each phase is timed with CUDA events like the blocks. Values go in with
``tel.record(loss=..., tokens=...)`` any time during the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from trainwatch.rank.recorder import LoopRecorder


class Watch:
    """The hooks on one model and optimizer; ``remove()`` takes them off."""

    def __init__(self, loop: LoopRecorder, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, first_step: int = 0):
        self.loop = loop
        self.next_step = first_step
        self.open = False
        self.values: dict[str, Any] = {}
        self._ended: tuple[int, tuple] | None = None
        self._phase: tuple[str, int, Any] | None = None  # (name, start ns, CUDA event)
        self._handles = [model.register_forward_pre_hook(self._forward_pre),
                         model.register_forward_hook(self._forward_post),
                         optimizer.register_step_pre_hook(self._optimizer_pre),
                         optimizer.register_step_post_hook(self._optimizer_post)]

    def remove(self) -> None:
        self.seal()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks
    def _forward_pre(self, module: Any, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if not self.open:
            self._begin()
        self._switch("forward")

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        if self.open and torch.is_grad_enabled():
            self._switch("backward")

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.open:
            self._begin()
        self._switch("optimizer")

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.open:
            return
        self._switch(None)
        loop = self.loop
        now = time.perf_counter_ns()
        # Sealed when the next step begins (or at a save, a skip, close): values the loop
        # records right after optimizer.step() still belong to this step.
        self._ended = (self.next_step, (loop.step_start_ns, now, loop.step_phase_ns,
                                        loop.step_cuda_events))
        loop.step_phase_ns, loop.step_cuda_events = {}, {}
        loop.phase_now = ("idle", now)
        self.open = False
        self.next_step += 1

    def seal(self) -> None:
        """Publish the step that ended, with every value recorded for it."""
        ended = self._ended
        if ended is not None:
            self._ended = None
            values, self.values = self.values, {}
            self.loop.end_step(ended[0], values, ended[1])

    # ------------------------------------------------------------------ internals
    def _begin(self) -> None:
        self.seal()
        loop = self.loop
        # The data phase the loop timed just before this step belongs to it.
        data_ns = loop.step_phase_ns.get("data", 0)
        loop.begin_step(self.next_step)
        if data_ns:
            loop.step_start_ns -= data_ns
            loop.step_phase_ns["data"] = data_ns
        self.open = True

    def _switch(self, name: str | None) -> None:
        loop = self.loop
        now = time.perf_counter_ns()
        current = self._phase
        if current is not None:
            phases = loop.step_phase_ns
            phases[current[0]] = phases.get(current[0], 0) + now - current[1]
            if current[2] is not None:
                loop.guard(lambda: loop.cuda_event_pair_end(current[0], current[2]))
        if name is None:
            self._phase = None
            loop.phase_now = ("step", now)
            return
        cuda_start = loop.guard(loop.cuda_event_pair_start) if loop.is_cuda else None
        self._phase = (name, now, cuda_start)
        loop.phase_now = (name, now)


class NoWatch:
    """What ``watch`` returns when telemetry is off: no hooks."""

    next_step = 0
    open = False

    def remove(self) -> None:
        pass

    def seal(self) -> None:
        pass
