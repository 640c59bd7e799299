"""The background side of a rank's telemetry: the heartbeat thread, and what it writes.

The loop only touches memory; this thread, every ``heartbeat_interval`` seconds, resolves
the finished steps (the only place recorded tensors are read), appends them to the
metrics log, and writes the status file and then the beat file. It keeps beating while
the loop is stuck, so a reader can tell "alive but not progressing" from "frozen or
dead". Only a failed write is a publish failure, told through the beat file (which still
gets through when the status and metrics log cannot be written: a full disk).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import psutil
import torch

from trainwatch.rank import reduction, step_lines
from trainwatch.rank.collective_progress import CollectiveProgress
from trainwatch.rank.replicas import KEEP, ReplicaCheck
from trainwatch.rank.status import beat_record, copy_status
from trainwatch.rank.step_lines import ENCODER
from trainwatch.rundir.atomic import append_lines
from trainwatch.rundir.beat import BeatWriter, beat_path
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger(__name__)


class Publisher:
    """Writes one rank's metrics log, status and beat file from the heartbeat thread.

    Handed the live status dict, its lock and a view of it (``view``: the dict with the
    loop's phase filled in), the loop's pending steps, how to count and guard errors, and
    what to do first at each status write (``before_status``: summarize the timing).
    """

    def __init__(self, run: RunDir, rank: int, *, device: torch.device,
                 process: psutil.Process, metrics_log: bool,
                 flops_per_token: float | None, peak_flops: float | None,
                 lock: threading.Lock, state: dict[str, Any], view: Callable[[], dict[str, Any]],
                 pending: Any, count_error: Callable[[str], None],
                 guard: Callable[[Callable[[], Any]], Any],
                 before_status: Callable[[], None]):
        self.run, self.rank, self.device, self.process = run, rank, device, process
        self.metrics_log = metrics_log
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.lock, self.state, self.view, self.pending = lock, state, view, pending
        self.count_error, self.guard, self.before_status = count_error, guard, before_status
        self.beat_lock = threading.Lock()  # one heartbeat's work at a time (publish_now)
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.replicas: ReplicaCheck | None = None
        self.reduction: reduction.ReductionCheck | None = None
        self.beat: BeatWriter | None = None
        self.collectives: CollectiveProgress | None = None  # made on the first beat
        self.step_lines = step_lines.StepLines(rank)
        # Status/metrics writes that failed, for the beat file.
        self.publish_errors = 0
        self.publish_failing_since: float | None = None
        self.publish_error: str | None = None
        self.failed_this_beat = False

    # ------------------------------------------------------------------ the thread
    def open_beat(self) -> None:
        self.beat = BeatWriter(beat_path(self.run.status_dir, self.rank))

    def start(self, beat: Callable[[], None], interval: Callable[[], float], name: str) -> None:
        """Run ``beat`` every ``interval()`` seconds on a daemon thread until ``stop``."""
        def loop() -> None:
            while not self.stop_event.wait(interval()):
                with self.beat_lock:
                    beat()
        self.thread = threading.Thread(target=loop, daemon=True, name=name)
        self.thread.start()

    @property
    def running(self) -> bool:
        return self.thread is not None and not self.stop_event.is_set()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=10)

    # ------------------------------------------------------------------ the metrics log
    def flush(self) -> None:
        """Resolve pending steps (the only place tensors are read) and append them to the log.

        Only a failed write is a publish failure (told through the beat file:
        TrainwatchCannotPublish); a value that cannot be read (a device's error, a
        collective's from a dead peer) is a telemetry error like any other.
        """
        if self.replicas is not None and self.replicas.taken:
            digests = self.replicas.resolve()
            with self.lock:
                self.state["replicas"] = (self.state["replicas"] + digests)[-KEEP:]
            # the history a rollback picks its clean checkpoint from
            self.log_records("replicas", digests, time.time())
        check = self.reduction
        if check is not None and check.taken:
            self._publish_reduction(check.resolve())
        if check is not None and check.dropped:
            dropped, check.dropped = check.dropped, 0
            self.count_error(f"{dropped} reduction checks dropped unread")
        # popleft, one at a time, because the loop appends without a lock
        pending = [self.pending.popleft() for _ in range(len(self.pending))]
        if not pending:
            return
        # Once per flush: reading RSS costs more than a whole step's bookkeeping.
        memory = _memory(self.device, self.process)
        text = self._lines(pending, memory)
        if self.metrics_log:
            data = text.encode()
            try:  # one append: whole lines, even if the process dies or the disk fills
                append_lines(self.run.metrics_file(self.rank), data)
            except OSError as exc:
                self.count_error(repr(exc))
                self.publish_failed(exc)

    def _publish_reduction(self, verdicts: list[reduction.Verdict]) -> None:
        """Checked buckets into the status; each mismatch counted, kept (the newest
        ``reduction.KEEP``) and logged once in the metrics log, the second source."""
        now = time.time()
        bad = [v.record() for v in verdicts if v.mismatch]
        with self.lock:
            state = self.state["reduction"]
            state["step"] = max(v.step for v in verdicts)
            if bad:
                state["mismatches"] = (state["mismatches"] + bad)[-reduction.KEEP:]
                self.state["counters"]["reduction_mismatches_total"] += len(bad)
                self.state["last_reduction_mismatch_at"] = now
        for record in bad:
            log.error("trainwatch: gradient all-reduce checksum mismatch at step %d, bucket "
                      "%d: reduced sum %s, expected %s (tolerance %.3g): docs/sdc.md",
                      record["step"], record["bucket"], record["reduced_sum"],
                      record["expected_sum"], record["tolerance"])
        self.log_records("reduction", bad, now)

    def log_records(self, kind: str, records: list[dict[str, Any]], now: float) -> None:
        """Records of ``kind`` into the rank's metrics log in one all-or-nothing append; a
        write that fails (a full disk) is a publish failure."""
        if not (records and self.metrics_log):
            return
        try:
            append_lines(self.run.metrics_file(self.rank), "".join(
                ENCODER.encode({"v": 1, "kind": kind, "time": now, "rank": self.rank, **r})
                + "\n" for r in records).encode())
        except OSError as exc:
            self.count_error(repr(exc))
            self.publish_failed(exc)

    def _lines(self, pending: list[tuple | dict], memory: dict[str, Any]) -> str:
        """The pending steps' lines (ready records as they are); the newest step's dict
        becomes the status's ``metrics``, and a non-finite loss or grad norm is counted."""
        texts, last, tail = [], None, self.step_lines.memory_tail(memory)
        fpt, peak = self.flops_per_token, self.peak_flops
        for p in pending:
            if isinstance(p, dict):
                texts.append(ENCODER.encode(p) + "\n")
                continue
            last = r = step_lines.resolve(p)
            self._count_nonfinite(r)
            texts.append(self.step_lines.text(r, memory, tail, fpt, peak))
        if last is not None:
            metrics = step_lines.as_dict(last, self.rank, memory, fpt, peak)
            with self.lock:
                self.state["metrics"] = metrics
        return "".join(texts)

    def _count_nonfinite(self, r: step_lines.Resolved) -> None:
        loss, grad_norm = step_lines.nonfinite(r[5])
        if loss or grad_norm:
            with self.lock:
                counters = self.state["counters"]
                if loss:
                    counters["nonfinite_loss_total"] += 1
                    self.state["last_nonfinite_loss_at"] = r[1]
                if grad_norm:
                    counters["nonfinite_grad_norm_total"] += 1

    # ------------------------------------------------------------------ status and beat
    def write_status(self) -> None:
        """Write the status file, then the beat file (which says whether publishing
        works: a reader must never mistake a full disk for a frozen rank)."""
        self.guard(self.before_status)
        with self.lock:
            self.state["heartbeat_at"] = time.time()
            self.state["heartbeat_mono"] = time.monotonic()
            snapshot = copy_status(self.view())
        try:
            self.run.write_status(self.rank, snapshot)
        except OSError as exc:  # the run directory cannot be written: a publish failure
            with self.lock:
                self.state["counters"]["telemetry_errors_total"] += 1
                count = self.state["counters"]["telemetry_errors_total"]
            if count <= 5 or count % 100 == 0:
                log.warning("trainwatch: could not write status (%d errors so far): %r",
                            count, exc)
            self.publish_failed(exc)
        except Exception as exc:  # a value that does not encode: not the disk
            self.count_error(f"status: {exc!r}")
        if not self.failed_this_beat:  # status and metrics log both written
            self.publish_failing_since = None
        self.failed_this_beat = False
        if self.beat is not None:
            try:
                self.beat.write(beat_record(
                    snapshot, self.rank, publish_errors=self.publish_errors,
                    publish_failing_since=self.publish_failing_since,
                    publish_error=self.publish_error, collectives=self._collectives()))
            except Exception as exc:
                self.count_error(f"beat file: {exc!r}")

    def _collectives(self) -> dict[str, list[int]] | None:
        """The beat's collective progress; a failure costs the field, never the beat."""
        try:
            if self.collectives is None:
                self.collectives = CollectiveProgress()
            return self.collectives.read()
        except Exception as exc:
            self.count_error(f"collective progress: {exc!r}")
            return None

    def close_beat(self) -> None:
        if self.beat is not None:
            self.beat.close()

    def publish_failed(self, exc: BaseException) -> None:
        self.failed_this_beat = True
        self.publish_errors += 1
        self.publish_error = repr(exc)
        if self.publish_failing_since is None:
            self.publish_failing_since = time.time()


def _memory(device: torch.device, process: psutil.Process) -> dict[str, Any]:
    if device.type == "cuda":
        return {"memory_bytes": torch.cuda.max_memory_allocated(device),
                "memory_kind": "cuda_peak_allocated"}
    return {"memory_bytes": process.memory_info().rss, "memory_kind": "rss"}
