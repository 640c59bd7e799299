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
"""

from __future__ import annotations

import functools
import collections
import contextlib
import json
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

from trainwatch.rundir.beat import BeatWriter, beat_path, own_window
from trainwatch import __version__
from trainwatch.contract.env import JOB_ENV, run_dir_from_env
from trainwatch.contract.layout import rank_source
from trainwatch.contract.states import EVAL_PHASE, FAILED, FINISHED, RUNNING, STEP_PHASE
from trainwatch.contract.timing import MIDDLE_HALF_WIDTH, RECENT_WINDOWS, standing
from trainwatch.host.cgroup import memory_cgroup
from trainwatch.node import boot_id, node_name
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import append_jsonl, append_lines
from trainwatch.rank import dumps, rejected_input, timing_exchange
from trainwatch.rank.flops import peak_flops_for
from trainwatch.rank import reduction
from trainwatch.rank.replicas import DEFAULT_EVERY, KEEP, ReplicaCheck

log = logging.getLogger(__name__)

# json.dumps builds a new encoder on every call that passes options; the flush reuses one.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _now() -> float:
    return time.time()


# The Telemetry started last in this process: ``Checkpoints.from_env()`` reports to it
# without being handed it, so the three-line setup stays three lines.
_current: "Telemetry | None" = None


def current() -> "Telemetry | None":
    """The telemetry this process started (and has not closed), or None."""
    return _current


class StepRecorder:
    """Handed out by ``Telemetry.step``; ``record`` attaches this step's values."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def record(self, **values: Any) -> None:
        """Loss, grad_norm, lr, tokens, samples or any other scalar; tensors stay on device."""
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                values[key] = _held(value)
        self.values.update(values)


class _StepBlock:
    """What ``Telemetry.step`` returns, one per Telemetry, reused every step."""

    __slots__ = ("tel", "step", "recorder")

    def __init__(self, tel: "Telemetry | None"):
        self.tel, self.step, self.recorder = tel, 0, StepRecorder()

    def __enter__(self) -> StepRecorder:
        self.recorder.values = {}  # the previous step's dict now belongs to its pending record
        if self.tel is not None:
            self.tel._begin_step(self.step)
        return self.recorder

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.tel is not None and exc_type is None:  # a failed step is no progress
            self.tel._end_step(self.step, self.recorder.values)


class _PhaseBlock:
    """What ``Telemetry.phase(name)`` returns; reused per name, so it keeps no state of its
    own: what to restore on exit goes on the telemetry's phase stack (nesting works)."""

    __slots__ = ("tel", "name")

    def __init__(self, tel: "Telemetry", name: str):
        self.tel, self.name = tel, name

    def __enter__(self) -> None:
        tel = self.tel
        cuda_start = tel._guard(tel._cuda_event_pair_start) if tel.is_cuda else None
        now = time.perf_counter_ns()
        tel._phase_stack.append((tel._phase, now, cuda_start))
        tel._phase = (self.name, now)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        tel, name = self.tel, self.name
        now = time.perf_counter_ns()
        tel._phase, started, cuda_start = tel._phase_stack.pop()
        phases = tel._step_phase_ns
        phases[name] = phases.get(name, 0) + now - started
        if cuda_start is not None:
            tel._guard(lambda: tel._cuda_event_pair_end(name, cuda_start))
        if name == EVAL_PHASE and tel._phase[0] != STEP_PHASE:  # between steps: say so
            tel._guard(lambda: tel._evaluated(now - started))



class Telemetry:
    """Publishes one rank's progress to the run directory; see the module docstring."""

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
        self.flops_per_token = flops_per_token
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        self.peak_flops = peak_flops if peak_flops is not None else (
            peak_flops_for(torch.cuda.get_device_name(self.device)) if self.is_cuda else None)
        self.metrics_log = metrics_log
        # Phases whose time includes waiting for other ranks (DDP's all-reduce runs in
        # backward); the rest of a step is "local" time, what straggler scoring compares.
        self.collective_phases = tuple(collective_phases)

        self._lock = threading.Lock()
        self._beat_lock = threading.Lock()  # one heartbeat's work at a time (publish_now)
        self._process = psutil.Process()
        # Finished steps as tuples (step, end time, step ns, phase ns, CUDA events per
        # phase, recorded values): the loop only appends, the thread resolves.
        # Steps to resolve (tuples), and ready lines (dicts: an evaluation between steps).
        self._pending: collections.deque[tuple | dict] = collections.deque(maxlen=max_pending)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._control_handlers: dict[str, Callable[[Path], None]] = {}
        self._control_paths: dict[str, Path] = {}
        self._control_seen: dict[str, float] = {}
        self._exchange_group = None
        # (works, sketch, own means, step, window steps, time) of the last all-reduce
        # until someone publishes it; guarded by _lock.
        self._exchange_in_flight: tuple | None = None
        # (step, window steps, time, own means, summed sketch) of the completed exchanges,
        # newest last, until the heartbeat thread summarizes them; guarded by _lock.
        self._windows: collections.deque = collections.deque(maxlen=RECENT_WINDOWS)
        # This rank's (step, ratio, z) in its last windows: the status's timing.recent.
        self._recent: collections.deque = collections.deque(maxlen=RECENT_WINDOWS)
        # The job summary keeps enough values around the median to leave out every rank
        # of one node (an agent compares its node with the rest).
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
        self._middle_half_width = max(MIDDLE_HALF_WIDTH,
                                      int(local_world) if local_world.isdigit() else 0)
        self._step_block = _StepBlock(self if enabled else None)
        self._phase_blocks: dict[str, _PhaseBlock] = {}
        self._phase_stack: list[tuple] = []  # (outer phase, start ns, CUDA event)
        self._null_phase = contextlib.nullcontext()
        # Wall time = perf_counter_ns() / 1e9 + offset: one clock read per phase boundary.
        # The heartbeat thread refreshes it, so a wall-clock step is followed within one beat.
        self._wall_offset = time.time() - time.perf_counter_ns() / 1e9
        # What this rank is doing and since when (perf_counter_ns), as one tuple: the loop
        # replaces it with a single store, so readers never see a name with another's time.
        self._phase: tuple[str, int] = ("init", time.perf_counter_ns())
        self._window_compute_ns = self._window_data_ns = self._window_local_ns = 0
        self._window_steps = 0

        now = _now()
        self._state: dict[str, Any] = {
            "job": self.job, "rank": rank, "local_rank": local_rank, "world_size": world_size,
            "node": node_name(), "pid": os.getpid(),
            # Its memory cgroup: after an OOM kill, diagnose reads the limit and kills there.
            "cgroup": memory_cgroup(),
            # Default: torchrun's count, which is per node (see train.agree_restart_count).
            "restart_count": restart_count if restart_count is not None else int(
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "backend": None, "device": str(self.device),
            "started_at": now, "heartbeat_at": now, "heartbeat_interval": heartbeat_interval,
            # This process's monotonic clock at the heartbeat, and the boot it counts from:
            # a reader on the same machine and boot measures ages on it, whatever this
            # rank's wall clock says (a clock minutes behind must not look stalled).
            "heartbeat_mono": time.monotonic(), "boot": boot_id(),
            # The kernel's start time of this process (boot time + ticks, not this rank's
            # wall clock): how an agent tells this process from a later one with its pid.
            "process_created_at": _created(self._process),
            "step": None, "steps_completed": None, "phase": "init",
            "phase_since": now, "last_progress_at": now, "state": RUNNING,
            "metrics": {}, "eval": {},
            "counters": {"steps_total": 0, "nonfinite_loss_total": 0,
                         "nonfinite_grad_norm_total": 0, "telemetry_errors_total": 0,
                         "pending_dropped_total": 0, "reduction_mismatches_total": 0},
            "last_nonfinite_loss_at": None,
            # The gradient checksum through the all-reduce (check_reduction), or None: its
            # interval, newest checked step and newest mismatches.
            "reduction": None, "last_reduction_mismatch_at": None,
            "timing": None, "checkpoint": None, "info": {},
            # The newest parameter digests (check_replicas), oldest first.
            "replicas": [],
            # Budgets of phases this job declared (declare_phase): seconds a rank may spend
            # in them without a step before the agent calls it stalled.
            "phase_budgets": {},
        }
        # Status/metrics writes that failed, for the beat file (which still gets through
        # when those cannot be written: a full disk).
        self._beat: BeatWriter | None = None
        self._publish_errors = 0
        self._publish_failing_since: float | None = None
        self._publish_error: str | None = None
        self._failed_this_beat = False
        self._finished_journaled = False
        self._watch: Any = None
        self._replicas: ReplicaCheck | None = None
        self._reduction: reduction.ReductionCheck | None = None
        self._next_step = 0
        self._step_start_ns = 0
        self._step_phase_ns: dict[str, int] = {}
        self._step_cuda_events: dict[str, list[tuple[Any, Any]]] = {}

    # ------------------------------------------------------------------ lifecycle
    @property
    def state(self) -> dict[str, Any]:
        """The live status dict; ``phase`` and ``phase_since`` are filled in from the loop's
        (name, since) pair on each read. Copy it under ``_lock`` (``snapshot``)."""
        name, since_ns = self._phase
        self._state["phase"], self._state["phase_since"] = (
            name, since_ns / 1e9 + self._wall_offset)
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
        self._beat = self._guard(lambda: BeatWriter(beat_path(self.run.status_dir, self.rank)))
        self._guard(self._setup_exchange_group)
        self._guard(lambda: dumps.install(self))  # control/dump -> stacks + flight recorder
        rejected_input.install(self)  # an uncaught ConfigError: failed, on bad input
        self._guard(lambda: self.run.append_event(
            "rank_started", rank_source(self.rank), rank=self.rank, pid=os.getpid(),
            restart_count=self._state["restart_count"]))
        if self.rank == 0:
            self._guard(self._describe_run)
        self._write_status()
        self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name=f"trainwatch-telemetry-rank{self.rank}")
        self._thread.start()
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
        return self._thread is not None and not self._stop.is_set()

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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self._state["state"] = state
            if failure is not None:
                self._state["failure"] = failure
        self.set_phase(state if state in (FINISHED, FAILED) else "idle")
        self._guard(self._flush)
        # A finished job's ranks all posted the last exchange: wait for it, or gloo aborts
        # the process at exit on the pending work; a failed rank must not wait on others.
        self._guard(lambda: self._collect_exchange(wait=state == FINISHED))
        # Let go of the process group: a Telemetry that outlives destroy_process_group (a
        # module-level global) must not keep gloo's worker threads running into shutdown.
        self._exchange_group = None
        self._write_status()
        if self._beat is not None:
            self._beat.close()

    def __enter__(self) -> "Telemetry":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(FAILED if exc_type else FINISHED)

    # ------------------------------------------------------------------ in the loop
    def step(self, step: int) -> _StepBlock:
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
        self._watch = (Watch(self, model, optimizer, first_step) if self.enabled
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
            self._replicas = check

    def check_reduction(self, ddp_model: torch.nn.Module, *,
                        every: int = reduction.DEFAULT_EVERY) -> reduction.ReductionCheck | None:
        """Carry a gradient checksum through DDP's all-reduce every ``every``-th step, so a
        reduction that went wrong on some GPU or link (every replica then holds the same
        wrong gradient, which replica digests cannot see) is counted in the status
        (docs/sdc.md). Takes DDP's one communication hook: a model that is not DDP or
        already has a hook is a ConfigError. Call on every rank before the first backward."""
        if not self.enabled:
            return None
        check = reduction.ReductionCheck(ddp_model, every, lambda: self._state["step"])
        self._reduction = check
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
            target[key] = _held(value) if isinstance(value, torch.Tensor) else value

    def continue_at(self, step: int) -> None:
        """The next step the loop runs (``Checkpoints`` tells after a resume, a save or a
        skipped step), so watched steps carry the loop's numbers."""
        self._next_step = step
        watch = self._watch
        if watch is not None and not watch.open:
            watch.seal()
            watch.next_step = step

    def phase(self, name: str) -> _PhaseBlock | contextlib.nullcontext:
        """Mark what this rank is doing (in the loop's thread); nested phases restore the
        outer one on exit."""
        if not self.enabled:
            return self._null_phase
        block = self._phase_blocks.get(name)
        if block is None:
            block = _PhaseBlock(self, name)
            if len(self._phase_blocks) < 256:  # names made up on the fly are not kept
                self._phase_blocks[name] = block
        return block

    def set_phase(self, name: str) -> None:
        self._phase = (name, time.perf_counter_ns())

    def _evaluated(self, nanoseconds: int) -> None:
        """An evaluation between steps, in the metrics log as the reference trainer's are
        (an ``eval`` record after the step): ``report`` books its time as evaluation, not
        as a stall (any loop's ``with tel.phase("eval")``)."""
        step = self._state.get("step")
        if isinstance(step, int):  # after a step (the report's anchor), in the log's order
            self._pending.append({"v": 1, "kind": EVAL_PHASE, "step": step, "time": _now(),
                                  "rank": self.rank, "seconds": round(nanoseconds / 1e9, 6)})

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
        self._control_handlers[name] = handler
        path = self._control_paths[name] = self.run.control_dir / name
        with contextlib.suppress(OSError):
            self._control_seen[name] = path.stat().st_mtime  # ignore stale requests

    # ------------------------------------------------------------------ internals
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
            return _copy(self.state)

    def _setup_exchange_group(self) -> None:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return
        backend = dist.get_backend()
        with self._lock:
            self._state["backend"] = backend
        if self.exchange_every and dist.get_world_size() > 1:
            # A CPU (gloo) side group: the exchange never touches the GPU stream and never
            # shows up in the training process group's collective sequence.
            self._exchange_group = (dist.group.WORLD if backend == "gloo"
                                    else dist.new_group(backend="gloo"))

    def _cuda_event_pair_start(self) -> Any:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _cuda_event_pair_end(self, name: str, start: Any) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._step_cuda_events.setdefault(name, []).append((start, end))

    def _begin_step(self, step: int) -> None:
        # Single stores only, in the loop's thread: readers copy under _lock, and no
        # value here spans two keys (the phase is one tuple).
        self._step_start_ns = now = time.perf_counter_ns()
        self._step_phase_ns = {}  # phases between steps (eval, checkpoint) count nowhere
        self._step_cuda_events = {}
        self._state["step"] = step
        self._phase = (STEP_PHASE, now)  # inside a step, between explicit phase blocks

    def _end_step(self, step: int, values: dict[str, Any],
                  ended: tuple[int, int, dict, dict] | None = None) -> None:
        """Record a finished step; ``ended`` is (start ns, end ns, phases, CUDA events) of
        a step that ended earlier (``watch`` seals a step only when the next one begins)."""
        try:
            if ended is None:
                start_ns, now = self._step_start_ns, time.perf_counter_ns()
                phases, cuda_events = self._step_phase_ns, self._step_cuda_events
                # The pending record owns these from here on; phases between steps go elsewhere.
                self._step_phase_ns, self._step_cuda_events = {}, {}
            else:
                start_ns, now, phases, cuda_events = ended
            step_ns = now - start_ns
            end_time = now / 1e9 + self._wall_offset
            # These counters have no writer but this thread; the deque is thread-safe.
            counters, pending = self._state["counters"], self._pending
            if len(pending) == pending.maxlen:
                counters["pending_dropped_total"] += 1
            pending.append((step, end_time, step_ns, phases, cuda_events, values))
            counters["steps_total"] += 1
            self._state["steps_completed"] = step + 1  # where the loop would resume
            self._state["last_progress_at"] = end_time
            replicas = self._replicas
            if replicas is not None and replicas.due(step):
                replicas.take(step)  # after the optimizer step; read by the thread
            if ended is None:
                self._phase = ("idle", now)  # between steps: the loop's own code
            if self.exchange_every:
                data_ns = phases.get("data", 0)
                local_ns = step_ns
                for name in self.collective_phases:
                    local_ns -= phases.get(name, 0)
                self._window_compute_ns += step_ns - data_ns
                self._window_data_ns += data_ns
                self._window_local_ns += local_ns
                self._window_steps += 1
                if (step + 1) % self.exchange_every == 0:
                    self._exchange_timings(step)
        except Exception as exc:  # telemetry must never fail the job
            self.count_error(repr(exc))

    def _exchange_timings(self, step: int) -> None:
        """One all-reduce of a fixed-size sketch of every rank's window means.

        It is started asynchronously and picked up by whoever sees it done first: the
        heartbeat thread, or the loop at the next exchange (then long finished, as every
        rank started it at the same step), so the loop never waits for the round trip.
        The heartbeat thread turns it into the rank's own means plus a constant-size job
        summary (``trainwatch.contract.timing``): neither the bytes exchanged nor the work
        nor the status file grows with the world size (``timing_exchange``).
        """
        n = max(1, self._window_steps)
        mine = [self._window_compute_ns / n / 1e9, self._window_data_ns / n / 1e9,
                self._window_local_ns / n / 1e9]
        self._window_compute_ns = self._window_data_ns = self._window_local_ns = 0
        self._window_steps = 0
        sketch = timing_exchange.local_sketch(self.rank, mine[2])
        if self._exchange_group is None:  # alone: the sum of one sketch is itself
            self._keep_window(step, n, _now(), mine, sketch)
            return
        import torch.distributed as dist
        with self.phase("telemetry_exchange"):
            self._collect_exchange(wait=True)
            works = timing_exchange.start(dist, self._exchange_group, sketch)
            with self._lock:
                self._exchange_in_flight = (works, sketch, mine, step, n, _now())

    def _collect_exchange(self, wait: bool) -> None:
        """Keep the in-flight exchange if it is done (or, with ``wait``, once it is)."""
        with self._lock:
            in_flight = self._exchange_in_flight
            if in_flight is None or not (wait or all(w.is_completed() for w in in_flight[0])):
                return
            self._exchange_in_flight = None
        works, sketch, mine, step, n, started = in_flight
        for work in works:
            work.wait()
        self._keep_window(step, n, started, mine, sketch)

    def _keep_window(self, step: int, n: int, started: float, own: list[float],
                       sketch: timing_exchange.Sketch) -> None:
        """Queue a completed window (own compute, data wait and local seconds; the job's
        summed sketch) for the heartbeat thread to summarize: O(1) here."""
        with self._lock:
            if not self._windows or self._windows[-1][0] < step:  # never behind a newer one
                self._windows.append((step, n, started, own, sketch))

    def _summarize_timing(self) -> None:
        """Publish the newest exchanged window as ``timing`` (own means + job summary),
        with this rank's standing in every window since the last beat as ``recent``."""
        with self._lock:
            pending = list(self._windows)
            self._windows.clear()
        timing = None
        for step, n, started, own, sketch in pending:
            if self._recent and self._recent[-1][0] >= step:
                continue  # an exchange that completed after a newer one was published
            job = timing_exchange.job_summary(sketch, self._middle_half_width)
            ratio, z = standing(job, own[2])
            self._recent.append([step, round(ratio, 4), round(z, 3)])
            timing = {"step": step, "window_steps": n, "time": started,
                      "compute_seconds": own[0], "data_wait_seconds": own[1],
                      "local_seconds": own[2], "job": job}
        if timing is None:
            return
        timing["recent"] = list(self._recent)
        with self._lock:
            current = self._state["timing"]
            if current is None or current["step"] < timing["step"]:
                self._state["timing"] = timing

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            with self._beat_lock:
                self._beat_once()

    def publish_now(self) -> None:
        """Write the pending steps and the status at once, not at the next heartbeat: an
        error nothing caught ends the process first, and its last steps and the phase it
        died in are what diagnose and report need."""
        with self._beat_lock:
            self._guard(self._flush)
            self._write_status()

    def _beat_once(self) -> None:
        """One heartbeat's work (benchmarks run it in step with the loop to count it)."""
        self._wall_offset = time.time() - time.perf_counter_ns() / 1e9
        self._guard(self._flush)
        if self._exchange_in_flight is not None:
            self._guard(lambda: self._collect_exchange(wait=False))
        self._guard(self._poll_control)
        self._write_status()

    def _poll_control(self) -> None:
        for name, handler in list(self._control_handlers.items()):
            path = self._control_paths[name]
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                continue
            if mtime > self._control_seen.get(name, 0.0):
                self._control_seen[name] = mtime
                self._guard(functools.partial(handler, path))

    def _flush(self) -> None:
        """Resolve pending steps (the only place tensors are read) and append them to the log.

        Only a failed write is a publish failure (told through the beat file:
        TrainwatchCannotPublish); a value that cannot be read (a device's error, a
        collective's from a dead peer) is a telemetry error like any other.
        """
        if self._replicas is not None and self._replicas.taken:
            digests = self._replicas.resolve()
            with self._lock:
                self._state["replicas"] = (self._state["replicas"] + digests)[-KEEP:]
            # the history a rollback picks its clean checkpoint from
            self._log_records("replicas", digests, _now())
        check = self._reduction
        if check is not None and check.taken:
            self._publish_reduction(check.resolve())
        if check is not None and check.dropped:
            dropped, check.dropped = check.dropped, 0
            self.count_error(f"{dropped} reduction checks dropped unread")
        # popleft, one at a time, because the loop appends without a lock
        pending = [self._pending.popleft() for _ in range(len(self._pending))]
        if not pending:
            return
        # Once per flush: reading RSS costs more than a whole step's bookkeeping.
        memory = _memory(self.device, self._process)
        lines = [p if isinstance(p, dict) else self._resolve(p, memory) for p in pending]
        steps = [line for line in lines if line["kind"] == "step"]
        if steps:
            with self._lock:
                self._state["metrics"] = steps[-1]
        if self.metrics_log:
            data = "".join([_ENCODER.encode(line) + "\n" for line in lines]).encode()
            try:  # one append: whole lines, even if the process dies or the disk fills
                append_lines(self.run.metrics_file(self.rank), data)
            except OSError as exc:
                self.count_error(repr(exc))
                self._publish_failed(exc)

    def _publish_reduction(self, verdicts: list[reduction.Verdict]) -> None:
        """Checked buckets into the status; each mismatch counted, kept (the newest
        ``reduction.KEEP``) and logged once in the metrics log, the second source."""
        now = _now()
        bad = [v.record() for v in verdicts if v.mismatch]
        with self._lock:
            state = self._state["reduction"]
            state["step"] = max(v.step for v in verdicts)
            if bad:
                state["mismatches"] = (state["mismatches"] + bad)[-reduction.KEEP:]
                self._state["counters"]["reduction_mismatches_total"] += len(bad)
                self._state["last_reduction_mismatch_at"] = now
        for record in bad:
            log.error("trainwatch: gradient all-reduce checksum mismatch at step %d, bucket "
                      "%d: reduced sum %s, expected %s (tolerance %.3g): docs/sdc.md",
                      record["step"], record["bucket"], record["reduced_sum"],
                      record["expected_sum"], record["tolerance"])
        self._log_records("reduction", bad, now)

    def _log_records(self, kind: str, records: list[dict[str, Any]], now: float) -> None:
        """Records of ``kind`` into the rank's metrics log in one all-or-nothing append; a
        write that fails (a full disk) is a publish failure."""
        if not (records and self.metrics_log):
            return
        try:
            append_lines(self.run.metrics_file(self.rank), "".join(
                _ENCODER.encode({"v": 1, "kind": kind, "time": now, "rank": self.rank, **r})
                + "\n" for r in records).encode())
        except OSError as exc:
            self.count_error(repr(exc))
            self._publish_failed(exc)

    def _resolve(self, p: tuple, memory: dict[str, Any]) -> dict[str, Any]:
        step, end_time, step_ns, phase_ns, cuda_events, recorded = p
        # Whole nanoseconds: the clock's resolution, and short to print.
        phases = {name: ns / 1e9 for name, ns in phase_ns.items()}
        for name, pairs in cuda_events.items():
            # Device time for GPU work; waiting here blocks only this thread.
            pairs[-1][1].synchronize()
            phases[name] = sum(s.elapsed_time(e) for s, e in pairs) / 1000.0
        step_seconds = step_ns / 1e9
        line: dict[str, Any] = {"v": 1, "kind": "step", "step": step, "time": end_time,
                                "rank": self.rank, "step_time_seconds": step_seconds,
                                "phase_seconds": phases,
                                "data_wait_seconds": phase_ns.get("data", 0) / 1e9}
        values: dict[str, Any] = {}
        for key, value in recorded.items():
            if isinstance(value, torch.Tensor):
                value = _scalar(value)
            values[key] = value
            if value is None or isinstance(value, (int, float, str)):  # what JSON can hold
                line[key] = value
        for key in ("loss", "grad_norm"):
            value = values.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                counter = "nonfinite_loss_total" if key == "loss" else "nonfinite_grad_norm_total"
                with self._lock:
                    self._state["counters"][counter] += 1
                    if key == "loss":
                        self._state["last_nonfinite_loss_at"] = end_time
        tokens, samples = values.get("tokens"), values.get("samples")
        if step_seconds > 0:
            if tokens:
                line["tokens_per_second"] = tokens / step_seconds
            if samples:
                line["samples_per_second"] = samples / step_seconds
        line["mfu"] = None
        if tokens and self.flops_per_token and self.peak_flops and step_seconds > 0:
            line["mfu"] = tokens * self.flops_per_token / step_seconds / self.peak_flops
        line.update(memory)
        return line

    def _write_status(self) -> None:
        """Write the status file, then the beat file (which says whether publishing
        works: a reader must never mistake a full disk for a frozen rank)."""
        self._guard(self._summarize_timing)
        with self._lock:
            self._state["heartbeat_at"] = _now()
            self._state["heartbeat_mono"] = time.monotonic()
            snapshot = _copy(self.state)
        try:
            self.run.write_status(self.rank, snapshot)
        except OSError as exc:  # the run directory cannot be written: a publish failure
            with self._lock:
                self._state["counters"]["telemetry_errors_total"] += 1
                count = self._state["counters"]["telemetry_errors_total"]
            if count <= 5 or count % 100 == 0:
                log.warning("trainwatch: could not write status (%d errors so far): %r",
                            count, exc)
            self._publish_failed(exc)
        except Exception as exc:  # a value that does not encode: not the disk
            self.count_error(f"status: {exc!r}")
        if not self._failed_this_beat:  # status and metrics log both written
            self._publish_failing_since = None
        self._failed_this_beat = False
        if self._beat is not None:
            try:
                self._beat.write(self._beat_record(snapshot))
            except Exception as exc:
                self.count_error(f"beat file: {exc!r}")

    def _publish_failed(self, exc: BaseException) -> None:
        self._failed_this_beat = True
        self._publish_errors += 1
        self._publish_error = repr(exc)
        if self._publish_failing_since is None:
            self._publish_failing_since = _now()

    def _beat_record(self, s: dict[str, Any]) -> dict[str, Any]:
        metrics = s.get("metrics") or {}
        phase = s.get("phase")
        return {"v": 1, "rank": self.rank, "pid": s["pid"], "state": s["state"],
                "heartbeat_at": s["heartbeat_at"], "heartbeat_mono": s["heartbeat_mono"],
                "boot": s["boot"], "step": s["step"], "steps_completed": s["steps_completed"],
                "last_progress_at": s["last_progress_at"],
                "steps_total": s["counters"]["steps_total"], "phase": phase,
                "phase_since": s["phase_since"],
                "phase_budget": s["phase_budgets"].get(phase),
                "step_time_seconds": metrics.get("step_time_seconds"),
                "timing_step": (s.get("timing") or {}).get("step"),
                "window": own_window(s.get("timing")),
                "replica_step": s["replicas"][-1]["step"] if s.get("replicas") else None,
                "publish_errors_total": self._publish_errors,
                "publish_failing_since": self._publish_failing_since,
                "last_publish_error": self._publish_error}


def _created(process: psutil.Process) -> float | None:
    try:
        return process.create_time()
    except psutil.Error:
        return None


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return list(obj)
    return obj


def _held(value: torch.Tensor) -> Any:
    """What a pending step keeps of a recorded tensor until the flush. A device tensor as
    it is (read by the heartbeat thread: no host/device sync in the loop), without its
    autograd graph. A CPU tensor is read now: there is nothing to wait for, and each small
    CPU tensor kept alive until the flush pinned 0.1-0.2 MiB of the C heap between the
    step's large temporaries (~20 MiB a rank at a second of ~10 ms steps). A value that
    cannot be read (a collective's output after its peer died) is kept for the flush, which
    counts the error: nothing raises into the loop."""
    if value.device.type == "cpu":
        try:
            return _scalar(value)
        except Exception:  # the flush reads it again and counts it
            pass
    return value.detach() if value.requires_grad else value


def _scalar(value: torch.Tensor) -> float | None:
    if value.numel() != 1:
        return None
    # What .float().item() gives, one dispatch cheaper for the usual float32.
    return value.item() if value.dtype == torch.float32 else value.float().item()


def _memory(device: torch.device, process: psutil.Process) -> dict[str, Any]:
    if device.type == "cuda":
        return {"memory_bytes": torch.cuda.max_memory_allocated(device),
                "memory_kind": "cuda_peak_allocated"}
    return {"memory_bytes": process.memory_info().rss, "memory_kind": "rss"}
