"""Rank telemetry for any torch training loop.

A few lines in a loop publish, per rank, the run-directory contract
(docs/run-directory.md): a status file (heartbeat, step, phase and since when,
latest metrics, its timing and a summary of the job's), a per-step metrics log and
journal events.

    tel = Telemetry.from_env("runs/exp1")          # RANK/LOCAL_RANK/WORLD_SIZE from torchrun
    tel.start()
    for step in range(steps):
        with tel.step(step) as s:
            with tel.phase("data"):
                x, y = next(batches)
            with tel.phase("forward"):
                loss = model(x, y)
            with tel.phase("backward"):
                loss.backward()
            with tel.phase("optimizer"):
                opt.step(); opt.zero_grad()
            s.record(loss=loss, lr=lr, tokens=x.numel(), samples=x.shape[0])
    tel.close()

Rules it keeps (never harm the job: telemetry is bounded and non-blocking):
* the loop only touches memory: files are written by a background thread,
  every ``heartbeat_interval`` seconds, so I/O never stalls a step;
* device tensors passed to ``record`` are kept as they are (no ``.item()``) and
  read by the background thread, so there is no per-step host/device sync; CPU
  tensors, with nothing to wait for, are read at once (held until the flush, each
  pinned a fraction of a MiB of the C heap);
* buffers are bounded; a telemetry failure is counted and logged, never raised;
* each block boundary in the loop costs one clock read (integer nanoseconds) and a
  few stores, no lock, in reused class context managers (generators and per-call
  objects cost several times more, and this runs several times per step): the phase
  is one (name, since) tuple that readers expand; the timing exchange is an
  asynchronous all-reduce of a fixed-size sketch picked up later, so the loop never
  waits for a round trip.
The background thread keeps writing heartbeats while the loop is stuck, so a
reader can tell "alive but not progressing" from "frozen or dead".

``Telemetry`` is the facade over parts with narrow interfaces, each handed only what it
needs (none imports this module): the loop side (``recorder.py``: step and phase blocks,
``record``), the background publisher (``publisher.py``: heartbeat thread, metrics log,
status and beat files; ``status.py``: what they hold), the timing exchange
(``window_exchange.py``), the control poller (``control_poller.py``: ``on_control``),
diagnostic dumps (``dumps.py``), the uncaught-error hook (``rejected_input.py``) and the
hooks of ``watch`` (``watch.py``).
"""


from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from trainwatch import __version__
from trainwatch.contract.env import JOB_ENV, run_dir_from_env
from trainwatch.contract.layout import rank_source
from trainwatch.contract.states import FAILED, FINISHED
from trainwatch.rank import dumps, reduction, rejected_input
from trainwatch.rank.control_poller import ControlPoller
from trainwatch.rank.flops import peak_flops_for
from trainwatch.rank.publisher import Publisher
from trainwatch.rank.recorder import LoopRecorder, PhaseBlock, PhaseBlocks, StepBlock, held
from trainwatch.rank.recorder import StepRecorder  # noqa: F401 - importable from here, as before
from trainwatch.rank.replicas import DEFAULT_EVERY, ReplicaCheck
from trainwatch.rank.status import copy_status, initial_status
from trainwatch.rank.timing_exchange import Sketch
from trainwatch.rank.window_exchange import WindowExchange
from trainwatch.rundir.atomic import append_jsonl
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger(__name__)


def _now() -> float:
    return time.time()


# The Telemetry started last in this process: ``Checkpoints.from_env()`` reports to it
# without being handed it, so the three-line setup stays three lines.
_current: "Telemetry | None" = None


def current() -> "Telemetry | None":
    """The telemetry this process started (and has not closed), or None."""
    return _current


class Telemetry:
    """Publishes one rank's progress to the run directory; see the module docstring.

    ``phase(name)`` (an attribute, the phase blocks' own lookup: no Python call in the
    loop) marks what this rank is doing, in the loop's thread; nested phases restore the
    outer one on exit."""

    def __init__(self, run_dir: str | Path, *, rank: int = 0, local_rank: int = 0,
                 world_size: int = 1, job: str | None = None, heartbeat_interval: float = 1.0,
                 exchange_every: int = 10, flops_per_token: float | None = None,
                 peak_flops: float | None = None, device: torch.device | str | None = None,
                 metrics_log: bool = True, max_pending: int = 1000, enabled: bool = True,
                 collective_phases: tuple[str, ...] = ("backward", "telemetry_exchange"),
                 restart_count: int | None = None):
        self.enabled = enabled
        self.run = RunDir(run_dir)
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.job = job or self.run.run_name(os.environ.get(JOB_ENV))
        self.heartbeat_interval = heartbeat_interval
        self.exchange_every = max(0, int(exchange_every))
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        if peak_flops is None and self.is_cuda:
            peak_flops = peak_flops_for(torch.cuda.get_device_name(self.device))
        # Phases whose time includes waiting for other ranks (DDP's all-reduce runs in
        # backward); the rest of a step is "local" time, what straggler scoring compares.
        self.collective_phases = tuple(collective_phases)

        self._lock = threading.Lock()
        process = psutil.Process()
        self._state: dict[str, Any] = initial_status(
            job=self.job, rank=rank, local_rank=local_rank, world_size=world_size,
            device=str(self.device), heartbeat_interval=heartbeat_interval,
            restart_count=restart_count, process=process)
        self._exchange = WindowExchange(rank, self._state, self._lock,
                                        lambda name: self.phase(name))
        self._loop = LoopRecorder(
            self._state, rank=rank, is_cuda=self.is_cuda, exchange_every=self.exchange_every,
            collective_phases=self.collective_phases, max_pending=max_pending,
            guard=self._guard, count_error=self.count_error, exchange=self._exchange.exchange)
        # The loop's finished steps, read by the publisher (the same deque, never replaced).
        self._pending = self._loop.pending
        self._publisher = Publisher(
            self.run, rank, device=self.device, process=process, metrics_log=metrics_log,
            flops_per_token=flops_per_token, peak_flops=peak_flops, lock=self._lock,
            state=self._state, view=lambda: self.state, pending=self._pending,
            count_error=self.count_error, guard=self._guard,
            before_status=self._exchange.summarize)
        self._control = ControlPoller(self.run.control_dir, self._guard)
        self._step_block = StepBlock(self._loop if enabled else None)
        self._phase_blocks = PhaseBlocks(self._loop if enabled else None)
        # ``tel.phase(name)``: mark what this rank is doing (in the loop's thread); nested
        # phases restore the outer one on exit. The dict's own lookup, no Python call: it
        # runs several times a step (``PhaseBlocks``).
        self.phase: Callable[[str], PhaseBlock | contextlib.nullcontext] = (
            self._phase_blocks.__getitem__)
        self._finished_journaled = False
        self._watch: Any = None
        self._next_step = 0

    # ------------------------------------------------------------------ settings
    @property
    def flops_per_token(self) -> float | None:
        """Training FLOPs per token (with ``peak_flops``, each step's MFU); may be set late."""
        return self._publisher.flops_per_token

    @flops_per_token.setter
    def flops_per_token(self, value: float | None) -> None:
        self._publisher.flops_per_token = value

    @property
    def peak_flops(self) -> float | None:
        """The device's peak FLOP/s (given, or known for the device), else None."""
        return self._publisher.peak_flops

    @peak_flops.setter
    def peak_flops(self, value: float | None) -> None:
        self._publisher.peak_flops = value

    @property
    def metrics_log(self) -> bool:
        """Whether steps and records are appended to the rank's metrics log."""
        return self._publisher.metrics_log

    @metrics_log.setter
    def metrics_log(self, value: bool) -> None:
        self._publisher.metrics_log = value

    # ------------------------------------------------------------------ lifecycle
    @property
    def state(self) -> dict[str, Any]:
        """The live status dict; ``phase`` and ``phase_since`` are filled in from the loop's
        (name, since) pair on each read. Copy it under ``_lock`` (``snapshot``)."""
        name, since_ns = self._loop.phase_now
        self._state["phase"], self._state["phase_since"] = (
            name, since_ns / 1e9 + self._loop.wall_offset)
        return self._state

    @classmethod
    def from_env(cls, run_dir: str | Path | None = None, **kwargs: Any) -> "Telemetry":
        """Build from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, and the run
        directory's variable, ``contract.env.RUN_DIR_ENV``)."""
        run_dir = run_dir or run_dir_from_env()
        kwargs.setdefault("rank", int(os.environ.get("RANK", "0")))
        kwargs.setdefault("local_rank", int(os.environ.get("LOCAL_RANK", "0")))
        kwargs.setdefault("world_size", int(os.environ.get("WORLD_SIZE", "1")))
        return cls(run_dir, **kwargs)

    def start(self) -> "Telemetry":
        """Create the run layout, join the timing exchange group, start the heartbeat thread.

        Call on every rank after ``init_process_group`` (the exchange group is created
        collectively).
        """
        if not self.enabled:
            return self
        self.run.create()
        self._guard(self._publisher.open_beat)
        self._guard(lambda: self._exchange.join(self.exchange_every))
        # control/dump -> stacks + flight recorder
        self._guard(lambda: dumps.install(
            self.on_control, rank=self.rank, dump_file=self.run.dump_file(self.rank),
            snapshot=self.snapshot, event=self.event))
        rejected_input.install(self)  # an uncaught ConfigError: failed, on bad input
        self._guard(lambda: self.run.append_event(
            "rank_started", rank_source(self.rank), rank=self.rank, pid=os.getpid(),
            restart_count=self._state["restart_count"]))
        if self.rank == 0:
            self._guard(self._describe_run)
        self._publisher.write_status()
        self._publisher.start(self._beat_once, lambda: self.heartbeat_interval,
                              name=f"trainwatch-telemetry-rank{self.rank}")
        global _current
        _current = self
        return self

    def _describe_run(self) -> None:
        """Fill in what ``run.json`` lacks (world size, command, start): readers such as
        ``trainwatch report`` need them whoever launched the job; a launcher's own values stay."""
        info = self.run.run_info() or {}
        now = _now()
        facts = {"job": self.job, "created_at": now, "started_at": now,
                 "world_size": self.world_size,
                 "command": info.get("command") or [os.path.basename(sys.executable),
                                                    *sys.argv],
                 "trainwatch_version": __version__}
        missing = {k: v for k, v in facts.items() if info.get(k) is None}
        if missing:
            self.run.write_run_info({**{k: v for k, v in info.items()
                                        if k not in ("format", "version")}, **missing})

    @property
    def running(self) -> bool:
        """Started and not yet closed."""
        return self._publisher.running

    def close(self, state: str = FINISHED, *, failure: dict[str, Any] | None = None) -> None:
        """Flush everything and write the final status (``finished``, ``stopped`` or
        ``failed``, with ``failure`` saying why when known); a finished job's rank 0
        journals ``finished`` unless the loop did."""
        global _current
        if _current is self:
            _current = None
        if not self.enabled:
            return
        if self._watch is not None:
            self._watch.seal()
        if state == FINISHED and self.rank == 0 and not self._finished_journaled:
            self.event("finished", step=self._state.get("step"),
                       steps_completed=self._state.get("steps_completed"))
        self._publisher.stop()
        with self._lock:
            self._state["state"] = state
            if failure is not None:
                self._state["failure"] = failure
        self.set_phase(state if state in (FINISHED, FAILED) else "idle")
        self._guard(self._publisher.flush)
        # A finished job's ranks all posted the last exchange: wait for it, or gloo aborts
        # the process at exit on the pending work; a failed rank must not wait on others.
        self._guard(lambda: self._exchange.collect(wait=state == FINISHED))
        self._exchange.release()
        self._publisher.write_status()
        self._publisher.close_beat()

    def __enter__(self) -> "Telemetry":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(FAILED if exc_type else FINISHED)

    # ------------------------------------------------------------------ in the loop
    def step(self, step: int) -> StepBlock:
        """Time one training step (``with tel.step(n) as s``, ``s`` a StepRecorder);
        progress is recorded when the block ends normally."""
        self._step_block.step = step
        return self._step_block

    def watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
              first_step: int | None = None) -> Any:
        """Time forward, backward and the optimizer and find each step by hooks, instead of
        ``step``/``phase`` blocks (keep ``phase("data")`` and custom phases). Steps are
        numbered from ``first_step`` (default: where ``Checkpoints`` resumed, else 0); record
        values with ``record``. Returns the hooks' handle (``remove()``)."""
        from trainwatch.rank.watch import NoWatch, Watch
        if self._watch is not None:
            self._watch.remove()
        if first_step is None:
            first_step = self._next_step
        self._watch = (Watch(self._loop, model, optimizer, first_step) if self.enabled
                       else NoWatch())
        return self._watch

    def check_replicas(self, model: torch.nn.Module, *, every: int = DEFAULT_EVERY,
                       optimizer: torch.optim.Optimizer | None = None,
                       tolerance: float | None = None, replica_group: int | str = 0) -> None:
        """Digest the parameters (and ``optimizer``'s state) after every ``every``-th step
        and publish the digest, so the agent can name a rank whose weights diverged from
        its replicas' (silent data corruption, docs/sdc.md). Ranks with the same
        ``replica_group`` hold replicas (default: every rank, as in DDP); ``tolerance``
        (relative, on the norm) for replicas that are not bitwise equal. Works with
        ``step`` blocks and with ``watch``."""
        check = ReplicaCheck(model, every, optimizer, tolerance, replica_group)
        if self.enabled:
            self._loop.replicas = self._publisher.replicas = check

    def check_reduction(self, ddp_model: torch.nn.Module, *,
                        every: int = reduction.DEFAULT_EVERY) -> reduction.ReductionCheck | None:
        """Carry a gradient checksum through DDP's all-reduce every ``every``-th step, so a
        reduction that went wrong on some GPU or link (every replica then holds the same
        wrong gradient, which replica digests cannot see) is counted in the status
        (docs/sdc.md). Takes DDP's one communication hook: a model that is not DDP or
        already has a hook is a ConfigError. Call on every rank before the first backward."""
        if not self.enabled:
            return None
        # The step from the status dict's own lookup: no Python call per bucket.
        check = reduction.ReductionCheck(ddp_model, every,
                                         functools.partial(self._state.__getitem__, "step"))
        self._publisher.reduction = check
        with self._lock:
            self._state["reduction"] = {"every": check.every, "step": None, "mismatches": []}
        return check

    def record(self, **values: Any) -> None:
        """Values of the current watched step (loss, grad_norm, lr, tokens, samples, ...);
        tensors stay on the device, as with ``StepRecorder.record``."""
        watch = self._watch
        target = watch.values if watch is not None and hasattr(watch, "values") else (
            self._step_block.recorder.values)
        for key, value in values.items():
            target[key] = held(value) if isinstance(value, torch.Tensor) else value

    def continue_at(self, step: int) -> None:
        """The next step the loop runs (``Checkpoints`` tells after a resume, a save or a
        skipped step), so watched steps carry the loop's numbers."""
        self._next_step = self._loop.next_step = step
        watch = self._watch
        if watch is not None and not watch.open:
            watch.seal()
            watch.next_step = step

    def set_phase(self, name: str) -> None:
        self._loop.phase_now = (name, time.perf_counter_ns())

    def log(self, step: int, kind: str = "eval", **values: float) -> None:
        """Record non-step metrics (validation loss, ...) in the metrics log and status."""
        if not self.enabled:
            return

        def write() -> None:
            clean = {k: float(v.item() if isinstance(v, torch.Tensor) else v)
                     for k, v in values.items()}
            with self._lock:
                self._state["eval"] = {"step": step, **clean}
            if self.metrics_log:
                append_jsonl(self.run.metrics_file(self.rank),
                             {"v": 1, "kind": kind, "step": step, "time": _now(),
                              "rank": self.rank, **clean})
        self._guard(write)

    def declare_phase(self, name: str, budget_seconds: float) -> None:
        """Give a phase of this loop its own stall budget (an evaluation or save that is
        longer than the agent's default for it, or one the agent does not know).

        While any rank of the job is in this phase, that rank and every rank waiting for
        it in a collective may go ``budget_seconds`` without a step before the agent calls
        the job stalled (docs/agent.md, "Stall budgets"). Call once, before the phase runs.
        """
        seconds = float(budget_seconds)
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"budget_seconds must be a positive number, got {budget_seconds!r}")
        with self._lock:
            self._state["phase_budgets"][str(name)] = seconds

    def set_info(self, **info: Any) -> None:
        """Static facts shown in the status file (model size, config hash, backend...)."""
        with self._lock:
            self._state["info"].update(info)

    def set_checkpoint(self, **checkpoint: Any) -> None:
        """Latest checkpoint facts (step, path, time, ok) for readers of the status file."""
        with self._lock:
            self._state["checkpoint"] = checkpoint

    def checkpoint_saved(self, path: str | Path, step: int, *, verified: bool = False,
                         **fields: Any) -> None:
        """Declare a checkpoint the job wrote itself (its own files, not ``Checkpoints``).

        ``step`` is the number of steps it holds (where a resume continues). The restart
        guard counts progress from it and the agent exports its age (CheckpointTooOld);
        trainwatch does not verify such files. Call on the rank that saved, after the file
        is complete. ``verified``: a checkpoint folder sealed with a trainwatch manifest (the
        framework adapters), which resume verifies.
        """
        now = _now()
        with self._lock:
            facts = dict(self._state.get("checkpoint") or {})
            facts.update(step=int(step), path=str(path), time=now, ok=True, last_error=None,
                         in_flight=False, declared=not verified,
                         saves_total=int(facts.get("saves_total") or 0) + 1)
            self._state["checkpoint"] = facts
        self.event("checkpoint_saved", step=int(step), path=str(Path(path).resolve()),
                   **({} if verified else {"declared": True}), **fields)

    def event(self, event: str, **fields: Any) -> None:
        """Append a journal event from this rank; failures are counted, never raised."""
        if event == "finished":
            self._finished_journaled = True
        if self.enabled:
            self._guard(lambda: self.run.append_event(event, rank_source(self.rank),
                                                      rank=self.rank, **fields))

    def on_control(self, name: str, handler: Callable[[Path], None]) -> None:
        """Call ``handler(path)`` from the heartbeat thread when ``control/<name>`` is touched.

        Requests are files so that anything (an operator, diagnose, the controller) can
        ask every rank at once, even while the loop is stuck in a collective.
        """
        self._control.on(name, handler)

    # ------------------------------------------------------------------ errors and readers
    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; count and log a failure instead of raising into the training loop."""
        try:
            return fn()
        except Exception as exc:  # telemetry must never fail the job
            self.count_error(repr(exc))
            return None

    def count_error(self, problem: str) -> None:
        """Count a telemetry failure in the status and log it (rate-limited)."""
        with self._lock:
            self._state["counters"]["telemetry_errors_total"] += 1
            count = self._state["counters"]["telemetry_errors_total"]
        if count <= 5 or count % 100 == 0:
            log.warning("trainwatch telemetry error (%d so far): %s", count, problem)

    def snapshot(self) -> dict[str, Any]:
        """A copy of the state the status file shows (for readers in this process)."""
        with self._lock:
            return copy_status(self.state)

    # ------------------------------------------------------------------ the heartbeat
    def publish_now(self) -> None:
        """Write the pending steps and the status at once, not at the next heartbeat: an
        error nothing caught ends the process first, and its last steps and the phase it
        died in are what diagnose and report need."""
        with self._publisher.beat_lock:
            self._guard(self._publisher.flush)
            self._publisher.write_status()

    def _beat_once(self) -> None:
        """One heartbeat's work (benchmarks run it in step with the loop to count it)."""
        self._loop.wall_offset = time.time() - time.perf_counter_ns() / 1e9
        self._guard(self._publisher.flush)
        if self._exchange.in_flight is not None:
            self._guard(lambda: self._exchange.collect(wait=False))
        self._guard(self._control.poll)
        self._publisher.write_status()

    # What the heartbeat does in parts, for tests and benchmarks that drive it by hand.
    def _flush(self) -> None:
        self._publisher.flush()

    def _write_status(self) -> None:
        self._publisher.write_status()

    def _keep_window(self, step: int, n: int, started: float, own: list[float],
                     sketch: Sketch) -> None:
        self._exchange.keep(step, n, started, own, sketch)

    def _summarize_timing(self) -> None:
        self._exchange.summarize()
