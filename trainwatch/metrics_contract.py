"""The one metrics contract: every metric name, type, unit and label set, defined once.

The agent exports exactly these; alert rules, dashboards and docs may only use
names declared here (a test checks it).  Naming follows DESIGN.md:
``trainwatch_<subsystem>_<what>_<unit>``, base units, ``_total`` for counters,
``_info`` gauges of value 1.  Labels never carry unbounded values.
"""

from __future__ import annotations

from dataclasses import dataclass

JOB_RANK = ("job", "node", "rank", "local_rank")
JOB_NODE = ("job", "node")
NODE = ("node",)
GPU = ("node", "gpu", "uuid")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str  # "gauge" | "counter" | "info"
    help: str
    labels: tuple[str, ...]
    unit: str = ""


def _m(name: str, type_: str, help_: str, labels: tuple[str, ...], unit: str = "") -> MetricSpec:
    return MetricSpec(name, type_, help_, labels, unit)


_SPECS = [
    # --- training progress, from the ranks' status files --------------------------------
    _m("trainwatch_train_loss", "gauge", "Latest training loss reported by the rank.", JOB_RANK),
    _m("trainwatch_train_grad_norm", "gauge", "Latest gradient norm (before clipping).", JOB_RANK),
    _m("trainwatch_train_learning_rate", "gauge", "Current learning rate.", JOB_RANK),
    _m("trainwatch_train_tokens_per_second", "gauge", "Training throughput in tokens/s.",
       JOB_RANK),
    _m("trainwatch_train_samples_per_second", "gauge", "Training throughput in samples/s.",
       JOB_RANK),
    _m("trainwatch_train_mfu_ratio", "gauge",
       "Model FLOPs utilisation (0-1); absent when the peak is unknown.", JOB_RANK, "ratio"),
    _m("trainwatch_train_validation_loss", "gauge", "Latest validation loss.", JOB_RANK),
    _m("trainwatch_train_nonfinite_loss_total", "counter",
       "Steps whose loss was NaN or Inf.", JOB_RANK),
    _m("trainwatch_train_nonfinite_grad_norm_total", "counter",
       "Steps whose gradient norm was NaN or Inf.", JOB_RANK),
    # --- per-rank timing, heartbeat and phase ---------------------------------------------
    _m("trainwatch_rank_step", "gauge", "Last step the rank started.", JOB_RANK),
    _m("trainwatch_rank_steps_total", "counter", "Steps completed by this rank process.",
       JOB_RANK),
    _m("trainwatch_rank_step_time_seconds", "gauge", "Wall time of the rank's last step.",
       JOB_RANK, "seconds"),
    _m("trainwatch_rank_phase_time_seconds", "gauge",
       "Time the last step spent in each phase.", JOB_RANK + ("phase",), "seconds"),
    _m("trainwatch_rank_data_wait_seconds", "gauge",
       "Time the last step waited for data.", JOB_RANK, "seconds"),
    _m("trainwatch_rank_heartbeat_age_seconds", "gauge",
       "Seconds since the rank's telemetry thread last wrote its status.", JOB_RANK, "seconds"),
    _m("trainwatch_rank_progress_age_seconds", "gauge",
       "Seconds since the rank last completed a step.", JOB_RANK, "seconds"),
    _m("trainwatch_rank_phase_age_seconds", "gauge",
       "Seconds the rank has been in its current phase.", JOB_RANK, "seconds"),
    _m("trainwatch_rank_phase", "gauge",
       "1 for the phase the rank is in now, 0 for the other known phases.",
       JOB_RANK + ("phase",)),
    _m("trainwatch_rank_memory_bytes", "gauge",
       "CUDA peak allocated bytes on GPU, resident set size on CPU.", JOB_RANK, "bytes"),
    _m("trainwatch_rank_up", "gauge",
       "1 if the rank's process is alive and not a zombie, else 0.", JOB_RANK),
    _m("trainwatch_rank_restarts", "gauge",
       "Restart count torchrun reports for the rank's current process.", JOB_RANK),
    _m("trainwatch_rank_telemetry_errors_total", "counter",
       "Telemetry failures counted (never raised) in the rank.", JOB_RANK),
]

# --- needed by the alert rules (issue 5, branch `alerts`) ------------------------------
# The agent (issue 4) must export these; the controller exports trainwatch_action_*.
# Kept in one separate block so the merge with the agent's full contract is easy.
JOB = ("job",)
STORAGE = ("node", "mountpoint")
NIC = ("node", "device")

_ALERT_SPECS = [
    _m("trainwatch_rank_compute_seconds", "gauge",
       "Mean compute time per step (step time minus data wait) over the last timing "
       "exchange window.", JOB_RANK, "seconds"),
    _m("trainwatch_checkpoint_age_seconds", "gauge",
       "Seconds since the newest verified checkpoint (since the run started when none).",
       JOB, "seconds"),
    _m("trainwatch_checkpoint_failures_total", "counter",
       "Checkpoint saves that failed (checkpoint_failed journal events).", JOB),
    _m("trainwatch_gpu_xid_errors_total", "counter", "XID errors reported by the driver.", GPU),
    _m("trainwatch_gpu_ecc_uncorrectable_errors_total", "counter",
       "Uncorrectable (double-bit) ECC errors.", GPU),
    _m("trainwatch_gpu_throttle_active", "gauge",
       "1 while the GPU clocks are throttled for the given reason (thermal, power).",
       GPU + ("reason",)),
    _m("trainwatch_nccl_errors_total", "counter",
       "NCCL errors and collective timeouts seen in the rank's logs or flight recorder.",
       JOB_RANK),
    _m("trainwatch_storage_free_bytes", "gauge", "Free bytes on the filesystem.", STORAGE,
       "bytes"),
    _m("trainwatch_storage_size_bytes", "gauge", "Size of the filesystem in bytes.", STORAGE,
       "bytes"),
    _m("trainwatch_storage_probe_duration_seconds", "gauge",
       "Time the last write+fsync+read probe of the filesystem took.", STORAGE, "seconds"),
    _m("trainwatch_network_errors_total", "counter",
       "Receive or transmit errors of a network interface.", NIC + ("direction",)),
    _m("trainwatch_network_carrier_changes_total", "counter",
       "Link up/down transitions of a network interface.", NIC),
    _m("trainwatch_agent_build_info", "info", "Version of the trainwatch agent (value 1).",
       ("node", "version")),
    _m("trainwatch_collector_success", "gauge",
       "1 if the collector's last run succeeded (or it is honestly absent), 0 if it failed.",
       ("node", "collector")),
    _m("trainwatch_action_restart_guard_tripped", "gauge",
       "1 once the controller stopped restarting a job that makes no forward progress.", JOB),
]
_SPECS += [s for s in _ALERT_SPECS if s.name not in {x.name for x in _SPECS}]

METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}

