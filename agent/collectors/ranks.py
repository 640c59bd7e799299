"""Ranks: every local rank's status file plus its OS process.

Reads each run directory through ``trainwatch.rundir.RunDir`` (torn, empty, alien or
newer-version status files are skipped, listed in /status and counted once per file
version), inspects each rank's process with psutil, and exports the trainwatch_train_*,
trainwatch_rank_*, trainwatch_process_* and (from the checkpoint library's facts in the
status files) trainwatch_checkpoint_* and the non-finite guard's series.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import Any

from trainwatch.host.procinfo import ProcessTracker
from trainwatch.agent.registry import Collector, Result, register
from trainwatch.contract.states import KNOWN_PHASES, PROCESS_STATES, RANK_STATES
from trainwatch.contract.timing import job_window
from trainwatch.errors import FormatError
from trainwatch.rundir import (RUN_FORMAT, SKIP_REASONS, Skipped, SkippedFile,
                               read_record)

_TRAIN_GAUGES = {  # status metrics field -> metric
    "loss": "trainwatch_train_loss", "grad_norm": "trainwatch_train_grad_norm",
    "lr": "trainwatch_train_learning_rate",
    "tokens_per_second": "trainwatch_train_tokens_per_second",
    "samples_per_second": "trainwatch_train_samples_per_second",
    "mfu": "trainwatch_train_mfu_ratio",
    "step_time_seconds": "trainwatch_rank_step_time_seconds",
    "data_wait_seconds": "trainwatch_rank_data_wait_seconds",
    "memory_bytes": "trainwatch_rank_memory_bytes",
}
_COUNTERS = {
    "steps_total": "trainwatch_rank_steps_total",
    "nonfinite_loss_total": "trainwatch_train_nonfinite_loss_total",
    "nonfinite_grad_norm_total": "trainwatch_train_nonfinite_grad_norm_total",
    "telemetry_errors_total": "trainwatch_rank_telemetry_errors_total",
}
_CHECKPOINT_COUNTERS = {  # checkpoint facts field -> job-level metric (max over ranks)
    "saves_total": "trainwatch_checkpoint_saves_total",
    "failures_total": "trainwatch_checkpoint_failures_total",
    "nonfinite_skipped_total": "trainwatch_train_nonfinite_skipped_steps_total",
}


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@register("ranks", interval=1.0, timeout=5.0, options={"max_skipped_shown": 10})
class RanksCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.procs = ProcessTracker(ctx.config.proc_root)
        self._skip_seen: dict[str, set[tuple[str, int, int]]] = {}
        self._skip_total: dict[str, dict[str, int]] = {}  # run dir -> reason code -> count
        self._skip_recent: dict[str, deque] = {}

    def collect(self) -> Result:
        result = Result()
        now = time.time()
        self.procs.begin()
        live: set[int] = set()
        jobs = []
        runs = self.ctx.run_dirs()
        result.add("trainwatch_collector_run_dirs", len(runs), node=self.ctx.node)
        for run in runs:
            job = self._job(run, now, result, live)
            if job is not None:
                jobs.append(job)
        self.procs.end(live)
        result.data = {"time": now, "jobs": jobs}
        return result

    # ------------------------------------------------------------------------------
    def _job(self, run, now: float, result: Result, live: set[int]) -> dict[str, Any] | None:
        statuses = run.statuses()
        info, info_skipped = self._run_info(run)
        if info_skipped is not None:
            statuses.skipped.append(info_skipped)
        # Unseen is not absent: what the agent may not read makes its health degraded.
        unreadable = [s.path for s in statuses.skipped if s.code == "permission_denied"]
        job_name = info.get("job") or run.root.resolve().name
        key = str(run.root)
        self._count_skipped(key, statuses.skipped)
        records = statuses.records  # typed and named after their rank (RunDir.statuses)
        if records:
            job_name = str(records[0].get("job") or job_name)
        local = self._local(records)
        # Each local rank carries the job's timing summary: no other node's file is needed.
        timing = job_window({r["rank"]: r.get("timing") for r in local})
        skipped_by_reason = self._skip_total.get(key, {})
        # Every reason from 0, so increase() sees the first skip (a counter born at 1 shows none).
        for reason in SKIP_REASONS:
            result.add("trainwatch_collector_status_files_skipped_total",
                       skipped_by_reason.get(reason, 0), run=job_name, node=self.ctx.node,
                       reason=reason)
        result.add("trainwatch_collector_run_files_unreadable", len(unreadable), run=job_name,
                   node=self.ctx.node)
        ranks = []
        env: dict[int, dict[str, str]] = {}
        for status in sorted(local, key=lambda r: r["rank"]):
            rank = self._rank(status, now, job_name, result)
            ranks.append(rank)
            if isinstance(status.get("pid"), int):
                live.add(status["pid"])
                env[rank["rank"]] = self.procs.env(status["pid"])
        self._checkpoint(local, info, now, job_name, result)
        backends = sorted({r["backend"] for r in ranks if r.get("backend")})
        return {"job": job_name, "run_dir": key,
                "backend": backends[0] if len(backends) == 1 else (backends or None),
                "world_size": info.get("world_size") or next(
                    (r.get("world_size") for r in records), None),
                "status_files_skipped_total": sum(skipped_by_reason.values()),
                "status_files_skipped_by_reason": dict(sorted(skipped_by_reason.items())),
                "skipped": list(self._skip_recent.get(key, ())),
                "unreadable": unreadable,
                "timing": timing, "ranks": ranks, "env": env,
                "checkpoint_dir": str(run.recorded_checkpoint_folders(info)[0])}

    def _run_info(self, run) -> tuple[dict[str, Any], Skipped | None]:
        """run.json, or {} and why not: permission denied is reported, never logged per run."""
        try:
            return read_record(run.run_file, RUN_FORMAT, root=run.root), None
        except SkippedFile as exc:
            return {}, Skipped(str(run.run_file), exc.detail, code=exc.reason)
        except FormatError:  # missing: a run that has not written it yet
            return {}, None

    def _checkpoint(self, local: list[dict[str, Any]], info: dict[str, Any], now: float,
                    job: str, result: Result) -> None:
        """Job-level checkpoint series from the ``checkpoint`` facts the checkpoint library
        publishes in each rank's status (absent: the job does not use it).

        Age: since the newest verified checkpoint any rank knows of, else (on rank 0's node)
        since the run started; only while a rank runs (a finished job needs none newer).
        Saves, failures, non-finite skips: the most any rank counted (rank 0 holds the save
        facts; a failed save is usually seen by every rank; every rank runs the guard).
        """
        facts = [r["checkpoint"] for r in local if isinstance(r.get("checkpoint"), dict)]
        if not facts:
            return
        labels = {"run": job, "node": self.ctx.node}
        for field, metric in _CHECKPOINT_COUNTERS.items():
            values = [_num(f.get(field)) for f in facts]
            result.add(metric, max((v for v in values if v is not None), default=None),
                       **labels)
        if not any(r.get("state", "running") == "running" for r in local):
            return
        # ``time`` is the newest verified save (or the resumed one); a later failure
        # (ok false) leaves it as it was. Rank 0 holds the save facts: a node without it
        # and without a known save has no age to report (CheckpointTooOld takes the min).
        saved = [_num(f.get("time")) for f in facts]
        since = max((t for t in saved if t is not None), default=None)
        if since is None and not any(r["rank"] == 0 for r in local):
            return
        if since is None:
            starts = [_num(r.get("started_at")) for r in local] + [_num(info.get("created_at"))]
            since = min((t for t in starts if t is not None), default=None)
        if since is not None:
            result.add("trainwatch_checkpoint_age_seconds", max(0.0, now - since), **labels)

    def _local(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Ranks of this node; a run dir on a shared filesystem holds every node's ranks."""
        names = {self.ctx.node, socket.gethostname()}
        mine = [r for r in records if r.get("node") in names]
        return mine if mine else records

    def _count_skipped(self, key: str, skipped) -> None:
        seen = self._skip_seen.setdefault(key, set())
        recent = self._skip_recent.setdefault(key, deque(maxlen=int(self.options["max_skipped_shown"])))
        totals = self._skip_total.setdefault(key, {})
        for item in skipped:
            try:
                st = os.lstat(item.path)  # the entry itself: never follow a hostile link
                version = (item.path, st.st_mtime_ns, st.st_size)
            except OSError:
                version = (item.path, 0, 0)
            if version in seen:
                continue
            seen.add(version)
            totals[item.code] = totals.get(item.code, 0) + 1
            recent.append({"path": item.path, "reason": item.reason, "code": item.code})
        if len(seen) > 10000:  # bounded memory for a directory that keeps producing junk
            seen.clear()

    def _rank(self, s: dict[str, Any], now: float, job: str, result: Result) -> dict[str, Any]:
        labels = {"run": job, "node": self.ctx.node, "rank": s["rank"],
                  "local_rank": s.get("local_rank", "")}
        metrics = s.get("metrics") if isinstance(s.get("metrics"), dict) else {}
        counters = s.get("counters") if isinstance(s.get("counters"), dict) else {}
        proc = self.procs.inspect(s.get("pid"), s.get("started_at"))
        state = s.get("state") if isinstance(s.get("state"), str) else "running"
        phase = s.get("phase") if isinstance(s.get("phase"), str) else None
        heartbeat_at, progress_at = _num(s.get("heartbeat_at")), _num(s.get("last_progress_at"))
        phase_since = _num(s.get("phase_since"))

        result.add("trainwatch_rank_info", 1, **labels, backend=s.get("backend") or "",
                   device=s.get("device") or "")
        for name in RANK_STATES:
            result.add("trainwatch_rank_state", name == state, **labels, state=name)
        result.add("trainwatch_rank_step", _num(s.get("step")), **labels)
        result.add("trainwatch_rank_restarts", _num(s.get("restart_count")), **labels)
        if heartbeat_at is not None:
            result.add("trainwatch_rank_heartbeat_age_seconds", max(0.0, now - heartbeat_at),
                       **labels)
        if progress_at is not None:
            result.add("trainwatch_rank_progress_age_seconds", max(0.0, now - progress_at),
                       **labels)
        if phase_since is not None:
            result.add("trainwatch_rank_phase_age_seconds", max(0.0, now - phase_since), **labels)
        if phase:
            for name in dict.fromkeys(KNOWN_PHASES + (phase,)):
                result.add("trainwatch_rank_phase", name == phase, **labels, phase=name)
        for field, metric in _TRAIN_GAUGES.items():
            result.add(metric, _num(metrics.get(field)), **labels)
        phases = metrics.get("phase_seconds")
        if isinstance(phases, dict):
            for name, seconds in phases.items():
                result.add("trainwatch_rank_phase_time_seconds", _num(seconds), **labels,
                           phase=name)
        evals = s.get("eval") if isinstance(s.get("eval"), dict) else {}
        result.add("trainwatch_train_validation_loss", _num(evals.get("val_loss")), **labels)
        result.add("trainwatch_train_last_nonfinite_loss_timestamp_seconds",
                   _num(s.get("last_nonfinite_loss_at")), **labels)
        for field, metric in _COUNTERS.items():
            result.add(metric, _num(counters.get(field)), **labels)

        alive = proc["status"] not in ("gone", "zombie", "unknown")
        result.add("trainwatch_rank_up", alive if proc["status"] != "unknown" else None,
                   **labels)
        for name in PROCESS_STATES:
            result.add("trainwatch_process_state", name == proc["status"], **labels, state=name)
        result.add("trainwatch_process_cpu_seconds_total", proc.get("cpu_seconds"), **labels)
        result.add("trainwatch_process_resident_memory_bytes", proc.get("rss_bytes"), **labels)
        result.add("trainwatch_process_threads", proc.get("threads"), **labels)
        result.add("trainwatch_process_cpu_contention_ratio", proc.get("cpu_contention_ratio"),
                   **labels)
        return {
            "rank": s["rank"], "local_rank": s.get("local_rank"), "node": s.get("node"),
            "pid": s.get("pid"), "state": state, "step": s.get("step"), "phase": phase,
            "phase_since": phase_since, "heartbeat_at": heartbeat_at,
            "last_progress_at": progress_at, "started_at": _num(s.get("started_at")),
            "restart_count": s.get("restart_count"), "backend": s.get("backend"),
            "device": s.get("device"), "world_size": s.get("world_size"),
            "metrics": {k: metrics.get(k) for k in (
                "step", "loss", "step_time_seconds", "data_wait_seconds", "tokens_per_second",
                "samples_per_second", "memory_bytes")},
            "process": proc,
        }
