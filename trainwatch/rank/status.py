"""What a rank's status file and beat file hold: the status's first state, a reader's copy
of it, and the beat record read off a copy (docs/run-directory.md)."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil

from trainwatch.contract.states import RUNNING
from trainwatch.host.cgroup import memory_cgroup
from trainwatch.host.pid_namespace import own_pid_namespace
from trainwatch.node import boot_id, node_name
from trainwatch.rundir.beat import own_window


def initial_status(*, job: str, rank: int, local_rank: int, world_size: int, device: str,
                   heartbeat_interval: float, restart_count: int | None,
                   process: psutil.Process) -> dict[str, Any]:
    """The live status dict of a rank that has not stepped yet."""
    now = time.time()
    return {
        "job": job, "rank": rank, "local_rank": local_rank, "world_size": world_size,
        "node": node_name(), "pid": os.getpid(),
        # The PID namespace ``pid`` counts in: in a pod of its own (no hostPID) the agent
        # finds the host's pid of this process by it (trainwatch/host/pid_namespace.py).
        "pid_namespace": own_pid_namespace(),
        # Its memory cgroup: after an OOM kill, diagnose reads the limit and kills there.
        "cgroup": memory_cgroup(),
        # Default: torchrun's count, which is per node (see train.agree_restart_count).
        "restart_count": restart_count if restart_count is not None else int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "backend": None, "device": device,
        "started_at": now, "heartbeat_at": now, "heartbeat_interval": heartbeat_interval,
        # This process's monotonic clock at the heartbeat, and the boot it counts from:
        # a reader on the same machine and boot measures ages on it, whatever this
        # rank's wall clock says (a clock minutes behind must not look stalled).
        "heartbeat_mono": time.monotonic(), "boot": boot_id(),
        # The kernel's start time of this process (boot time + ticks, not this rank's
        # wall clock): how an agent tells this process from a later one with its pid.
        "process_created_at": _created(process),
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


def copy_status(obj: Any) -> Any:
    """A copy deep enough that the loop's later stores do not reach it (dicts and lists)."""
    if isinstance(obj, dict):
        return {k: copy_status(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return list(obj)
    return obj


def beat_record(s: dict[str, Any], rank: int, *, publish_errors: int,
                publish_failing_since: float | None,
                publish_error: str | None,
                collectives: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The beat file's record of a status copy, of this rank's publish failures and of its
    collective progress (``collectives``: trainwatch/rank/collective_progress.py)."""
    metrics = s.get("metrics") or {}
    phase = s.get("phase")
    return {"v": 1, "rank": rank, "pid": s["pid"], "state": s["state"],
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
            "publish_errors_total": publish_errors,
            "publish_failing_since": publish_failing_since,
            "last_publish_error": publish_error, "collectives": collectives}


def _created(process: psutil.Process) -> float | None:
    try:
        return process.create_time()
    except psutil.Error:
        return None
