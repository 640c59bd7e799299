"""The loop side of a rank's telemetry: step and phase blocks, recorded values, and the
finished steps it leaves for the background thread.

This is the code the training loop runs several times per step, so it is kept cheap
(``Telemetry`` hands out these objects; the loop never goes through the facade for them):
* each block boundary costs one clock read (integer nanoseconds) and a few stores, no
  lock, in reused class context managers (generators and per-call objects cost several
  times more): the phase is one (name, since) tuple that readers expand;
* device tensors passed to ``record`` are kept as they are (no ``.item()``) and read by
  the background thread, so there is no per-step host/device sync; CPU tensors, with
  nothing to wait for, are read at once (held until the flush, each pinned a fraction of
  a MiB of the C heap);
* a finished step is one tuple appended to a bounded deque; every ``exchange_every``
  steps the window's means go to the timing exchange (``window_exchange.py``), whose
  all-reduce is asynchronous.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Callable

import torch

from trainwatch.contract.states import EVAL_PHASE, STEP_PHASE
from trainwatch.rank.replicas import ReplicaCheck

# Bound once: a block boundary reads the clock without looking up ``time`` first.
_clock = time.perf_counter_ns
# What a step timed on no device holds for its CUDA events (shared, never written).
_NO_EVENTS: dict[str, list[tuple[Any, Any]]] = {}


class StepRecorder:
    """Handed out by ``Telemetry.step``; ``record`` attaches this step's values."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def record(self, **values: Any) -> None:
        """Loss, grad_norm, lr, tokens, samples or any other scalar; tensors stay on device."""
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                values[key] = held(value)
        self.values.update(values)


class StepBlock:
    """What ``Telemetry.step`` returns, one per Telemetry, reused every step."""

    __slots__ = ("loop", "step", "recorder")

    def __init__(self, loop: "LoopRecorder | None"):
        self.loop, self.step, self.recorder = loop, 0, StepRecorder()

    def __enter__(self) -> StepRecorder:
        self.recorder.values = {}  # the previous step's dict now belongs to its pending record
        if self.loop is not None:
            self.loop.begin_step(self.step)
        return self.recorder

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.loop is not None and exc_type is None:  # a failed step is no progress
            self.loop.end_step(self.step, self.recorder.values)


class PhaseBlock:
    """What ``Telemetry.phase(name)`` returns; reused per name, so it keeps no state of its
    own: what to restore on exit goes on the recorder's phase stack (nesting works).

    The plain kind (a CPU rank, any phase but ``eval``) does only what every block must:
    one clock read, the phase tuple, the stack, the step's sum for the name. The others
    are subclasses picked once per name (``block_for``), so their checks cost the plain
    kind nothing."""

    __slots__ = ("loop", "name")

    def __init__(self, loop: "LoopRecorder", name: str):
        self.loop, self.name = loop, name

    def __enter__(self) -> None:
        loop = self.loop
        now = _clock()
        loop.phase_stack.append((loop.phase_now, now))
        loop.phase_now = (self.name, now)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        now = _clock()
        loop = self.loop
        loop.phase_now, started = loop.phase_stack.pop()
        phases, name = loop.step_phase_ns, self.name
        phases[name] = phases.get(name, 0) + now - started


class CudaPhaseBlock(PhaseBlock):
    """On a GPU: the phase also timed on the device, by a pair of CUDA events."""

    __slots__ = ()

    def __enter__(self) -> None:
        loop = self.loop
        loop.cuda_starts.append(loop.guard(loop.cuda_event_pair_start))
        super().__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        super().__exit__(exc_type, exc, tb)
        loop, name = self.loop, self.name
        cuda_start = loop.cuda_starts.pop()
        if cuda_start is not None:
            loop.guard(lambda: loop.cuda_event_pair_end(name, cuda_start))


class EvalPhaseBlock(PhaseBlock):
    """``eval``: between steps it is an evaluation of its own in the metrics log."""

    __slots__ = ()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        now = _clock()
        loop = self.loop
        loop.phase_now, started = loop.phase_stack.pop()
        phases = loop.step_phase_ns
        phases[EVAL_PHASE] = phases.get(EVAL_PHASE, 0) + now - started
        if loop.phase_now[0] != STEP_PHASE:  # between steps: say so
            loop.guard(lambda: loop.evaluated(now - started))


class CudaEvalPhaseBlock(CudaPhaseBlock, EvalPhaseBlock):
    """``eval`` on a GPU: both of the above."""

    __slots__ = ()


class PhaseBlocks(dict):
    """The blocks by phase name; ``Telemetry.phase`` is this dict's own ``__getitem__``, so a
    known name costs the loop no Python call before the block's ``__enter__``. A new name
    gets its block here (a disabled telemetry's: one shared no-op block); names made up on
    the fly are not kept past ``KEEP``."""

    KEEP = 256

    def __init__(self, loop: "LoopRecorder | None"):
        super().__init__()
        self.loop = loop
        self.null = contextlib.nullcontext()

    def __missing__(self, name: str) -> Any:
        block = self.null if self.loop is None else block_for(self.loop, name)
        if len(self) < self.KEEP:
            self[name] = block
        return block


def block_for(loop: "LoopRecorder", name: str) -> PhaseBlock:
    """The block kind a phase of this name needs on this rank."""
    if name == EVAL_PHASE:
        return (CudaEvalPhaseBlock if loop.is_cuda else EvalPhaseBlock)(loop, name)
    return (CudaPhaseBlock if loop.is_cuda else PhaseBlock)(loop, name)


class LoopRecorder:
    """The loop's own state: what it is doing and since when, the open step's phase times,
    the finished steps not yet published, the timing window's sums.

    Written only by the loop's thread, in single stores (the status dict's readers copy it
    under the telemetry's lock; no value here spans two keys). It is handed what it needs:
    the live status dict, how to count an error, and where a full window goes.
    """

    def __init__(self, state: dict[str, Any], *, rank: int, is_cuda: bool,
                 exchange_every: int, collective_phases: tuple[str, ...], max_pending: int,
                 guard: Callable[[Callable[[], Any]], Any], count_error: Callable[[str], None],
                 exchange: Callable[[int, int, list[float]], None]):
        self.state, self.rank, self.is_cuda = state, rank, is_cuda
        self.exchange_every = exchange_every
        # Phases whose time includes waiting for other ranks (DDP's all-reduce runs in
        # backward); the rest of a step is "local" time, what straggler scoring compares.
        self.collective_phases = collective_phases
        self.guard, self.count_error = guard, count_error
        # (step, n, own means): a full window to the timing exchange.
        self.exchange = exchange
        # Finished steps as tuples (step, end time, step ns, phase ns, CUDA events per
        # phase, recorded values): the loop only appends, the thread resolves.
        # Steps to resolve (tuples), and ready lines (dicts: an evaluation between steps).
        self.pending: collections.deque[tuple | dict] = collections.deque(maxlen=max_pending)
        self.replicas: ReplicaCheck | None = None
        self.phase_stack: list[tuple] = []  # (outer phase, start ns)
        self.cuda_starts: list[Any] = []  # beside it on a GPU: each open block's start event
        # Wall time = perf_counter_ns() / 1e9 + offset: one clock read per phase boundary.
        # The heartbeat thread refreshes it, so a wall-clock step is followed within one beat.
        self.wall_offset = time.time() - time.perf_counter_ns() / 1e9
        # What this rank is doing and since when (perf_counter_ns), as one tuple: the loop
        # replaces it with a single store, so readers never see a name with another's time.
        self.phase_now: tuple[str, int] = ("init", time.perf_counter_ns())
        self.window_compute_ns = self.window_data_ns = self.window_local_ns = 0
        self.window_steps = 0
        self.window: list[tuple] = []  # the window's steps not yet in its sums (fold_window)
        self.step_start_ns = 0
        self.step_phase_ns: dict[str, int] = {}
        self.step_cuda_events: dict[str, list[tuple[Any, Any]]] = {}
        # The step the loop runs next before its first (0, or where Checkpoints resumed).
        self.next_step = 0

    def cuda_event_pair_start(self) -> Any:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def cuda_event_pair_end(self, name: str, start: Any) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.step_cuda_events.setdefault(name, []).append((start, end))

    def evaluated(self, nanoseconds: int) -> None:
        """An evaluation between steps, in the metrics log as the reference trainer's are
        (an ``eval`` record after the step): ``report`` books its time as evaluation, not
        as a stall or start-up (any loop's ``with tel.phase("eval")``). Before this
        launch's first step (a loop that evaluates first, a resume that does) the record
        carries the step the loop runs next (``next_step``) and ``before_step``; its
        ``seconds`` place it."""
        step = self.state.get("step")
        record = {"v": 1, "kind": EVAL_PHASE, "step": step, "time": time.time(),
                  "rank": self.rank, "seconds": round(nanoseconds / 1e9, 6)}
        if not isinstance(step, int):
            record.update(step=self.next_step, before_step=True)
        self.pending.append(record)  # in the log's order, after the step it follows

    def begin_step(self, step: int) -> None:
        # Single stores only, in the loop's thread: readers copy under the lock, and no
        # value here spans two keys (the phase is one tuple).
        self.step_start_ns = now = _clock()
        if self.step_phase_ns:  # phases between steps (eval, checkpoint) count nowhere
            self.step_phase_ns = {}
        if self.step_cuda_events:
            self.step_cuda_events = {}
        self.state["step"] = step
        self.phase_now = (STEP_PHASE, now)  # inside a step, between explicit phase blocks

    def end_step(self, step: int, values: dict[str, Any],
                 ended: tuple[int, int, dict, dict] | None = None) -> None:
        """Record a finished step; ``ended`` is (start ns, end ns, phases, CUDA events) of
        a step that ended earlier (``watch`` seals a step only when the next one begins)."""
        try:
            if ended is None:
                start_ns, now = self.step_start_ns, _clock()
                phases, cuda_events = self.step_phase_ns, self.step_cuda_events
                # The pending record owns these from here on; phases between steps go elsewhere.
                self.step_phase_ns = {}
                if cuda_events:
                    self.step_cuda_events = {}
                else:  # none timed (on a CPU, always): the loop's own stays empty, reused
                    cuda_events = _NO_EVENTS
            else:
                start_ns, now, phases, cuda_events = ended
            step_ns = now - start_ns
            end_time = now / 1e9 + self.wall_offset
            # These counters have no writer but this thread; the deque is thread-safe.
            counters, pending = self.state["counters"], self.pending
            if len(pending) == pending.maxlen:
                counters["pending_dropped_total"] += 1
            entry = (step, end_time, step_ns, phases, cuda_events, values)
            pending.append(entry)
            counters["steps_total"] += 1
            self.state["steps_completed"] = step + 1  # where the loop would resume
            self.state["last_progress_at"] = end_time
            replicas = self.replicas
            if replicas is not None and not (step + 1) % replicas.every:  # due, no call
                replicas.take(step)  # after the optimizer step; read by the thread
            if ended is None:
                self.phase_now = ("idle", now)  # between steps: the loop's own code
            if self.exchange_every:
                # The window's sums are taken when it is full, from its steps' records
                # (here one append a step); a loop whose step numbers never fill it is
                # folded into the sums now and then, so the list stays bounded.
                window = self.window
                window.append(entry)
                if (step + 1) % self.exchange_every == 0:
                    self.fold_window()
                    n = max(1, self.window_steps)
                    mine = [self.window_compute_ns / n / 1e9, self.window_data_ns / n / 1e9,
                            self.window_local_ns / n / 1e9]
                    self.window_compute_ns = self.window_data_ns = self.window_local_ns = 0
                    self.window_steps = 0
                    self.exchange(step, n, mine)
                elif len(window) >= 4 * self.exchange_every:
                    self.fold_window()
        except Exception as exc:  # telemetry must never fail the job
            self.count_error(repr(exc))

    def fold_window(self) -> None:
        """Add the window's steps not yet summed to its sums: compute (all but the data
        wait), data wait, and local time (all but the collective phases)."""
        collective = self.collective_phases
        for entry in self.window:
            step_ns, phases = entry[2], entry[3]
            data_ns = phases.get("data", 0)
            local_ns = step_ns
            for name in collective:
                local_ns -= phases.get(name, 0)
            self.window_compute_ns += step_ns - data_ns
            self.window_data_ns += data_ns
            self.window_local_ns += local_ns
        self.window_steps += len(self.window)
        self.window = []


def held(value: torch.Tensor) -> Any:
    """What a pending step keeps of a recorded tensor until the flush. A device tensor as
    it is (read by the heartbeat thread: no host/device sync in the loop), without its
    autograd graph. A CPU tensor is read now: there is nothing to wait for, and each small
    CPU tensor kept alive until the flush pinned 0.1-0.2 MiB of the C heap between the
    step's large temporaries (~20 MiB a rank at a second of ~10 ms steps). A value that
    cannot be read (a collective's output after its peer died) is kept for the flush, which
    counts the error: nothing raises into the loop."""
    if value.device.type == "cpu":
        try:
            return scalar(value)
        except Exception:  # the flush reads it again and counts it
            pass
    return value.detach() if value.requires_grad else value


def scalar(value: torch.Tensor) -> float | None:
    if value.numel() != 1:
        return None
    # What .float().item() gives, one dispatch cheaper for the usual float32.
    return value.item() if value.dtype == torch.float32 else value.float().item()
