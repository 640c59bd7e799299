"""The one metrics contract: every metric name, type, unit and label set, defined once.

The agent exports exactly these; alert rules, dashboards and docs may only use
names declared here (a test checks it).  Naming follows Prometheus conventions:
``trainwatch_<subsystem>_<what>_<unit>``, base units, ``_total`` for counters,
``_info`` gauges of value 1.  Labels never carry unbounded values.
"""

from __future__ import annotations

from dataclasses import dataclass

# The training run's id is the label ``run``: ``job`` belongs to Prometheus (the scrape job,
# ``trainwatch-agent``), and an exporter's own ``job`` would be renamed ``exported_job`` or
# overwrite the scrape job under default label handling.
RUN_LABEL = "run"
RUN = (RUN_LABEL,)
RUN_RANK = (RUN_LABEL, "node", "rank", "local_rank")
RUN_NODE = (RUN_LABEL, "node")
NODE = ("node",)
GPU = ("node", "gpu", "uuid")
RANK_GPU = RUN_RANK + ("gpu", "uuid")
COLLECTOR = ("node", "collector")
STORAGE = ("node", RUN_LABEL, "role", "mountpoint")
DEVICE = ("node", "device")
IB_PORT = ("node", "device", "port")
PEER = ("node", RUN_LABEL, "role", "peer")
LINK = ("node", RUN_LABEL, "peer")

# Set by both the receiver and the embedded engine's loop (whichever runs the actions).
RESTART_GUARD_METRIC = "trainwatch_action_restart_guard_tripped"


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
    _m("trainwatch_train_loss", "gauge", "Latest training loss reported by the rank.", RUN_RANK),
    _m("trainwatch_train_grad_norm", "gauge", "Latest gradient norm (before clipping).", RUN_RANK),
    _m("trainwatch_train_learning_rate", "gauge", "Current learning rate.", RUN_RANK),
    _m("trainwatch_train_tokens_per_second", "gauge", "Training throughput in tokens/s.",
       RUN_RANK),
    _m("trainwatch_train_samples_per_second", "gauge", "Training throughput in samples/s.",
       RUN_RANK),
    _m("trainwatch_train_mfu_ratio", "gauge",
       "Model FLOPs utilisation (0-1); absent when the peak is unknown.", RUN_RANK, "ratio"),
    _m("trainwatch_train_validation_loss", "gauge", "Latest validation loss.", RUN_RANK),
    _m("trainwatch_train_nonfinite_loss_total", "counter",
       "Steps whose loss was NaN or Inf.", RUN_RANK),
    _m("trainwatch_train_last_nonfinite_loss_timestamp_seconds", "gauge",
       "Unix time of the newest step whose loss was NaN or Inf; absent if none.", RUN_RANK,
       "seconds"),
    _m("trainwatch_train_nonfinite_grad_norm_total", "counter",
       "Steps whose gradient norm was NaN or Inf.", RUN_RANK),
    # --- per-rank timing, heartbeat and phase ---------------------------------------------
    _m("trainwatch_rank_step", "gauge", "Last step the rank started.", RUN_RANK),
    _m("trainwatch_rank_steps_total", "counter", "Steps completed by this rank process.",
       RUN_RANK),
    _m("trainwatch_rank_step_time_seconds", "gauge", "Wall time of the rank's last step.",
       RUN_RANK, "seconds"),
    _m("trainwatch_rank_phase_time_seconds", "gauge",
       "Time the last step spent in each phase.", RUN_RANK + ("phase",), "seconds"),
    _m("trainwatch_rank_data_wait_seconds", "gauge",
       "Time the last step waited for data.", RUN_RANK, "seconds"),
    _m("trainwatch_rank_heartbeat_age_seconds", "gauge",
       "Seconds since the rank's telemetry thread last wrote its status.", RUN_RANK, "seconds"),
    _m("trainwatch_rank_progress_age_seconds", "gauge",
       "Seconds since the rank last completed a step.", RUN_RANK, "seconds"),
    _m("trainwatch_rank_phase_age_seconds", "gauge",
       "Seconds the rank has been in its current phase.", RUN_RANK, "seconds"),
    _m("trainwatch_rank_phase", "gauge",
       "1 for the phase the rank is in now, 0 for the other known phases.",
       RUN_RANK + ("phase",)),
    _m("trainwatch_rank_memory_bytes", "gauge",
       "CUDA peak allocated bytes on GPU, resident set size on CPU.", RUN_RANK, "bytes"),
    _m("trainwatch_rank_up", "gauge",
       "1 if the rank's process is alive and not a zombie, else 0.", RUN_RANK),
    _m("trainwatch_rank_restarts", "gauge",
       "Restart count torchrun reports for the rank's current process.", RUN_RANK),
    _m("trainwatch_rank_telemetry_errors_total", "counter",
       "Telemetry failures counted (never raised) in the rank.", RUN_RANK),
    _m("trainwatch_rank_publish_failing", "gauge",
       "1 while the rank cannot write its status file or metrics log (a full or failing "
       "disk), as its beat file says; the rank itself may train on. Absent for ranks "
       "without a beat file.", RUN_RANK),
    _m("trainwatch_rank_info", "info",
       "1 per rank; labels name its process-group backend and torch device.",
       RUN_RANK + ("backend", "device")),
    _m("trainwatch_rank_state", "gauge",
       "1 for the rank's reported lifecycle state (running, finished, failed, stopped), "
       "0 for the others.",
       RUN_RANK + ("state",)),
    _m("trainwatch_rank_local_seconds", "gauge",
       "Mean per-step time outside collective phases over the last timing window (own speed).",
       RUN_RANK, "seconds"),
    # --- stall detection (agent/stall.py) ---------------------------------------------------
    _m("trainwatch_rank_stalled", "gauge",
       "1 while the rank's step has not advanced within its stall budget, else 0.", RUN_RANK),
    _m("trainwatch_rank_stall_seconds", "gauge",
       "Seconds since the last progress of a stalled rank; 0 when not stalled.",
       RUN_RANK, "seconds"),
    _m("trainwatch_rank_stall_budget_seconds", "gauge",
       "The stall budget currently applied to the rank: max(floor, k x typical step) or its "
       "phase's budget.", RUN_RANK, "seconds"),
    _m("trainwatch_rank_stall_info", "info",
       "1 while the rank is stalled; kind is stuck (alive, heartbeat fresh), busy (process "
       "runnable and burning CPU outside a collective phase: C code holding the GIL, its "
       "heartbeat stale, or a spin in Python, its heartbeat fresh), frozen (heartbeat "
       "stale or process stopped) or dead; phase is where it stalled.",
       RUN_RANK + ("kind", "phase")),
    _m("trainwatch_rank_stalls_total", "counter",
       "Stalls detected for the rank since the agent started, by kind.", RUN_RANK + ("kind",)),
    # --- stall incidents (agent/incident.py): one per run and node ------------------------
    _m("trainwatch_stall_incident_ranks", "gauge",
       "This node's ranks of the run in its open stall incident, by role: culprit (dead, "
       "frozen, busy, or stuck outside the collective the others wait in) or waiting; 0 when "
       "there is none.", RUN_NODE + ("role",)),
    _m("trainwatch_stall_incident_seconds", "gauge",
       "Seconds since the run's open stall incident on this node began (the first stalled "
       "rank's last progress); present only while one is open. culprit_rank is the rank "
       "this node's evidence blames, or unknown (all its stalled ranks wait); kind is that "
       "rank's stall kind (dead, frozen, busy, stuck) or unknown.",
       RUN_NODE + ("culprit_rank", "kind"), "seconds"),
    # --- processes of the local ranks (psutil) -------------------------------------------
    _m("trainwatch_process_state", "gauge",
       "1 for the OS state of the rank's process (running, sleeping, disk_sleep, stopped, "
       "zombie, gone, unknown), 0 for the others.", RUN_RANK + ("state",)),
    _m("trainwatch_process_cpu_seconds_total", "counter",
       "User+system CPU time of the rank's process.", RUN_RANK, "seconds"),
    _m("trainwatch_process_resident_memory_bytes", "gauge",
       "Resident set size of the rank's process.", RUN_RANK, "bytes"),
    _m("trainwatch_process_threads", "gauge", "Threads in the rank's process.", RUN_RANK),
    _m("trainwatch_process_cpu_contention_ratio", "gauge",
       "Share (0-1) of the CPU time available on the rank's allowed cores that other "
       "processes used over the last interval.", RUN_RANK, "ratio"),
    # --- straggler detection (agent/straggler.py) ------------------------------------------
    _m("trainwatch_straggler_score", "gauge",
       "Robust z-score of the rank's per-step local time against the job (median/MAD).",
       RUN_RANK),
    _m("trainwatch_straggler_time_ratio", "gauge",
       "Rank's per-step local time divided by the median of the other ranks, the median of "
       "the last few timing windows: the level the straggler verdict follows "
       "(1 = typical, 1.25 = 0.8x speed).",
       RUN_RANK, "ratio"),
    _m("trainwatch_straggler_slow_windows", "gauge",
       "Consecutive timing windows in which the rank was slower than straggler.clear_ratio.",
       RUN_RANK),
    _m("trainwatch_straggler_active", "gauge",
       "1 while the rank is flagged as a straggler, else 0.", RUN_RANK),
    _m("trainwatch_straggler_info", "info",
       "1 while the rank is flagged; cause is the likely reason from node evidence "
       "(gpu_thermal, gpu_power, gpu_throttle, cpu_contention, storage, data_wait, "
       "network_errors, unknown).", RUN_RANK + ("cause",)),
    _m("trainwatch_straggler_node_time_ratio", "gauge",
       "Median local time of this node's ranks divided by the job median.", RUN_NODE, "ratio"),
    _m("trainwatch_straggler_node_active", "gauge",
       "1 while this node's ranks as a group are flagged as stragglers, else 0.", RUN_NODE),
    # --- GPU (NVML) ----------------------------------------------------------------------
    _m("trainwatch_gpu_info", "info", "1 per GPU; labels name the model.", GPU + ("name",)),
    _m("trainwatch_gpu_utilization_ratio", "gauge",
       "Share (0-1) of the last sample period a kernel was running.", GPU, "ratio"),
    _m("trainwatch_gpu_memory_used_bytes", "gauge", "Framebuffer memory in use.", GPU, "bytes"),
    _m("trainwatch_gpu_memory_total_bytes", "gauge", "Framebuffer memory installed.", GPU,
       "bytes"),
    _m("trainwatch_gpu_temperature_celsius", "gauge", "GPU core temperature.", GPU, "celsius"),
    _m("trainwatch_gpu_power_watts", "gauge", "Power draw.", GPU, "watts"),
    _m("trainwatch_gpu_power_limit_watts", "gauge", "Enforced power limit.", GPU, "watts"),
    _m("trainwatch_gpu_sm_clock_hertz", "gauge", "Current SM clock.", GPU, "hertz"),
    _m("trainwatch_gpu_sm_clock_max_hertz", "gauge", "Maximum SM clock.", GPU, "hertz"),
    _m("trainwatch_gpu_clock_event_active", "gauge",
       "1 while the clock-event (throttle) reason is active: gpu_idle, applications_clocks, "
       "sw_power_cap, hw_slowdown, sync_boost, sw_thermal, hw_thermal, hw_power_brake, "
       "display_clocks.", GPU + ("reason",)),
    _m("trainwatch_gpu_ecc_errors_total", "counter",
       "Volatile ECC error count since the driver loaded, by type (corrected, uncorrected).",
       GPU + ("type",)),
    _m("trainwatch_gpu_retired_pages", "gauge",
       "Pages retired by the driver, by cause (single_bit, double_bit).", GPU + ("cause",)),
    _m("trainwatch_gpu_retired_pages_pending", "gauge",
       "1 if page retirement waits for a GPU reset.", GPU),
    _m("trainwatch_gpu_remapped_rows", "gauge",
       "Rows remapped, by type (correctable, uncorrectable).", GPU + ("type",)),
    _m("trainwatch_gpu_remapped_rows_pending", "gauge",
       "1 if a row remapping waits for a GPU reset.", GPU),
    _m("trainwatch_gpu_remapped_rows_failed", "gauge", "1 if a row remapping failed.", GPU),
    _m("trainwatch_gpu_xid_events_recent", "gauge",
       "XID events seen in the last xid window (returns to 0 when they stop), by XID code.",
       GPU + ("xid",)),
    _m("trainwatch_gpu_xid_events_total", "counter",
       "XID events seen since the agent started, by XID code.", GPU + ("xid",)),
    _m("trainwatch_gpu_nvlink_errors_total", "counter",
       "NVLink error counters, by link and type (replay, recovery, crc_flit, crc_data).",
       GPU + ("link", "type")),
    _m("trainwatch_gpu_pcie_replay_total", "counter", "PCIe replay counter.", GPU),
    _m("trainwatch_gpu_process_memory_bytes", "gauge",
       "GPU memory used by a training rank's process (mapped by pid).", RANK_GPU, "bytes"),
    # --- NCCL / collectives ----------------------------------------------------------------
    _m("trainwatch_nccl_ras_up", "gauge",
       "1 if NCCL's RAS endpoint answered; absent when the job does not use NCCL.", RUN_NODE),
    _m("trainwatch_nccl_ras_communicators", "gauge",
       "Communicators the RAS endpoint reports.", RUN_NODE),
    _m("trainwatch_nccl_ras_ranks_missing", "gauge",
       "Ranks the RAS endpoint reports as missing or unreachable.", RUN_NODE),
    _m("trainwatch_nccl_ras_errors", "gauge",
       "Communicator errors (async errors, aborts) the RAS endpoint reports.", RUN_NODE),
    _m("trainwatch_nccl_log_warnings_total", "counter",
       "NCCL WARN lines seen in NCCL_DEBUG_FILE logs since the agent started.", RUN_NODE),
    _m("trainwatch_nccl_env_consistent", "gauge",
       "1 if NCCL_*/TORCH_* environment is identical across the node's ranks, else 0.",
       RUN_NODE),
    _m("trainwatch_nccl_env_mismatches", "gauge",
       "Number of NCCL_*/TORCH_* variables that differ across the node's ranks.", RUN_NODE),
    # --- storage (run, checkpoint, data dirs) ----------------------------------------------
    _m("trainwatch_storage_size_bytes", "gauge", "Filesystem size.", STORAGE, "bytes"),
    _m("trainwatch_storage_free_bytes", "gauge", "Bytes available to unprivileged users.",
       STORAGE, "bytes"),
    _m("trainwatch_storage_files", "gauge", "Inodes in the filesystem.", STORAGE),
    _m("trainwatch_storage_files_free", "gauge", "Free inodes.", STORAGE),
    _m("trainwatch_storage_readonly", "gauge", "1 if the filesystem is mounted read-only.",
       STORAGE),
    _m("trainwatch_storage_probe_success", "gauge",
       "1 if the last write+fsync+read probe finished within its timeout.", STORAGE),
    _m("trainwatch_storage_probe_skipped", "gauge",
       "1 if the agent's user may not write into the directory (a job's own run "
       "directory), so it is not probed; its filesystem's latency is then unmeasured.",
       STORAGE),
    _m("trainwatch_storage_probe_duration_seconds", "gauge",
       "Duration of the last completed write+fsync+read probe.", STORAGE, "seconds"),
    _m("trainwatch_storage_time_to_full_seconds", "gauge",
       "Predicted seconds until free bytes reach 0 at the recent fill rate (+Inf when not "
       "filling).", STORAGE, "seconds"),
    _m("trainwatch_storage_read_bytes_total", "counter", "Bytes read from the block device.",
       DEVICE, "bytes"),
    _m("trainwatch_storage_written_bytes_total", "counter", "Bytes written to the block device.",
       DEVICE, "bytes"),
    _m("trainwatch_storage_io_time_seconds_total", "counter",
       "Time the block device was busy with I/O.", DEVICE, "seconds"),
    # --- network (NICs, InfiniBand/RoCE, peers) ---------------------------------------------
    _m("trainwatch_network_up", "gauge", "1 if the interface's operstate is up.", DEVICE),
    _m("trainwatch_network_receive_bytes_total", "counter", "Bytes received.", DEVICE, "bytes"),
    _m("trainwatch_network_transmit_bytes_total", "counter", "Bytes sent.", DEVICE, "bytes"),
    _m("trainwatch_network_receive_errors_total", "counter", "Receive errors.", DEVICE),
    _m("trainwatch_network_transmit_errors_total", "counter", "Transmit errors.", DEVICE),
    _m("trainwatch_network_receive_drops_total", "counter", "Received packets dropped.", DEVICE),
    _m("trainwatch_network_transmit_drops_total", "counter", "Sent packets dropped.", DEVICE),
    _m("trainwatch_network_carrier_changes_total", "counter",
       "Link carrier changes (link flaps).", DEVICE),
    _m("trainwatch_network_ib_port_active", "gauge",
       "1 if the InfiniBand/RoCE port state is ACTIVE.", IB_PORT),
    _m("trainwatch_network_ib_port_info", "info",
       "1 per InfiniBand/RoCE port; labels give state, physical state and link layer.",
       IB_PORT + ("state", "phys_state", "link_layer")),
    _m("trainwatch_network_ib_rate_bytes_per_second", "gauge",
       "Port's negotiated rate.", IB_PORT, "bytes"),
    _m("trainwatch_network_ib_receive_bytes_total", "counter",
       "Bytes received on the port (port_rcv_data x 4).", IB_PORT, "bytes"),
    _m("trainwatch_network_ib_transmit_bytes_total", "counter",
       "Bytes sent on the port (port_xmit_data x 4).", IB_PORT, "bytes"),
    _m("trainwatch_network_ib_errors_total", "counter",
       "Port error counters by name (symbol_error, port_rcv_errors, link_downed, "
       "link_error_recovery, port_xmit_discards, ...); link_downed counts flaps.",
       IB_PORT + ("counter",)),
    _m("trainwatch_network_peer_up", "gauge",
       "1 if the last TCP connect to the peer (the job's master or a configured peer) "
       "succeeded.", PEER),
    _m("trainwatch_network_peer_connect_seconds", "gauge",
       "Duration of the last successful TCP connect to the peer.", PEER, "seconds"),
    # --- links: the ranks' own TCP connections, per peer address (agent/link_view.py) ---
    _m("trainwatch_link_rtt_seconds", "gauge",
       "Round-trip time the kernel measures on the node's ranks' connections to the peer "
       "address now: the median of those that carried data in the last 10 s; absent when "
       "none did.", LINK, "seconds"),
    _m("trainwatch_link_min_rtt_seconds", "gauge",
       "Best round-trip time of those connections (the kernel's min_rtt, a windowed "
       "minimum over about 5 minutes): how fast the link was.", LINK, "seconds"),
    _m("trainwatch_link_retransmits_total", "counter",
       "TCP segments the node's ranks retransmitted to the peer address, counted by the "
       "agent from each connection's growth.", LINK),
    _m("trainwatch_link_connections", "gauge",
       "TCP connections the node's ranks hold to the peer address.", LINK),
    _m("trainwatch_link_unseen_processes", "gauge",
       "Running ranks of the node whose connections the agent may not read (another "
       "user's process, another network namespace without root): their links are missing.",
       RUN_NODE),
    # --- versions ------------------------------------------------------------------------
    _m("trainwatch_versions_info", "info",
       "1; labels give driver, CUDA, torch, NCCL, Python and trainwatch versions on the node "
       "('' when unknown), so skew across nodes can alert.",
       NODE + ("driver", "cuda", "torch", "nccl", "python", "trainwatch")),
    # --- the agent itself (self-metrics) ---------------------------------------------------
    _m("trainwatch_collector_up", "gauge",
       "1 if the collector's last run succeeded, 0 if it failed, timed out or is absent.",
       COLLECTOR),
    _m("trainwatch_collector_state", "gauge",
       "1 for the collector's state (ok, failed, timeout, absent, pending), 0 for the others; "
       "the error reason is in /status.", COLLECTOR + ("state",)),
    _m("trainwatch_collector_duration_seconds", "gauge",
       "Duration of the collector's last completed run.", COLLECTOR, "seconds"),
    _m("trainwatch_collector_last_success_timestamp_seconds", "gauge",
       "Unix time of the collector's last successful run.", COLLECTOR, "seconds"),
    _m("trainwatch_collector_runs_total", "counter", "Runs started.", COLLECTOR),
    _m("trainwatch_collector_errors_total", "counter", "Runs that raised.", COLLECTOR),
    _m("trainwatch_collector_timeouts_total", "counter",
       "Runs abandoned after the collector's timeout (hung).", COLLECTOR),
    _m("trainwatch_collector_status_files_skipped_total", "counter",
       "Status file (and run.json) versions skipped, by reason (trainwatch.rundir.safe_read.SKIP_REASONS: special "
       "files, links out of the run directory, too large, not JSON, nested too deeply, "
       "alien, unknown version, rank not the one in the file name, wrong field types).",
       RUN_NODE + ("reason",)),
    _m("trainwatch_collector_run_files_unreadable", "gauge",
       "Files and folders of the run the agent may not read now (permission denied: the "
       "status folder, status files, run.json); its ranks there are unseen, not absent.",
       RUN_NODE),
    _m("trainwatch_collector_journal_lines_skipped_total", "counter",
       "Journal lines the agent skipped as torn, alien (not an object, unknown record "
       "version, no event name) or longer than its read cap.", RUN_NODE),
    _m("trainwatch_collector_journal_unreadable", "gauge",
       "1 while the agent cannot read the run's journal (permission denied, not a regular "
       "file, a link out of the run directory): alerts, restarts and the supervisor's stop "
       "it records are unseen; 0 otherwise.", RUN_NODE),
    _m("trainwatch_collector_journal_replaced_total", "counter",
       "Times the agent found the run's journal replaced (another file), truncated, "
       "rewritten or removed while the run went on: what it said before is lost to report "
       "and diagnose (trainwatch only appends to it).", RUN_NODE),
    _m("trainwatch_collector_run_dirs", "gauge", "Run directories the agent watches.", NODE),
    _m("trainwatch_collector_agent_cpu_seconds_total", "counter",
       "CPU time used by the agent process.", NODE, "seconds"),
    _m("trainwatch_collector_agent_resident_memory_bytes", "gauge",
       "Resident set size of the agent process.", NODE, "bytes"),
]

# --- alerts and controller -------------------------------------------------------------
# Checkpoint facts come from the checkpoint library's `checkpoint` field in the ranks'
# status files (the agent's ranks collector exports them); trainwatch_action_* is
# exported by the alert controller itself (`trainwatch run` / the webhook receiver).
_SPECS += [
    _m("trainwatch_checkpoint_age_seconds", "gauge",
       "Seconds since the newest verified checkpoint of the run (since the run started when "
       "there is none).", RUN_NODE, "seconds"),
    _m("trainwatch_checkpoint_failures_total", "counter",
       "Checkpoint saves of the run that failed (the most any of the node's ranks counted; "
       "resets when the job restarts).", RUN_NODE),
    _m(RESTART_GUARD_METRIC, "gauge",
       "1 once the controller stopped restarting a job that makes no forward progress.",
       RUN),
    _m("trainwatch_receiver_other_run_alerts_total", "counter",
       "Alerts the webhook receiver of this run was sent for another run (one Alertmanager "
       "webhook for several runs): dropped without a journal line.", RUN),
]

# --- what the run's journal and checkpoint facts say happened (agent collectors `journal`
# and `ranks`, branch `journalmetrics`). Every event is journaled once by one writer, so
# where several nodes read one shared journal, take max by (run, ...) across nodes.
_SPECS += [
    _m("trainwatch_alert_fired_total", "counter",
       "Alerts that fired for the run (alert_firing events in its journal), by rule; names "
       "outside the rules set past the agent's cap, and unknown severities, are 'other'.",
       RUN_NODE + ("alertname", "severity")),
    _m("trainwatch_action_taken_total", "counter",
       "Automated actions the controller took for the run (action_taken events), by action.",
       RUN_NODE + ("action",)),
    _m("trainwatch_action_skipped_total", "counter",
       "Automated actions the controller decided not to take (action_skipped events: dry "
       "run, rate limit, restart guard, duplicate delivery, ...), by action.",
       RUN_NODE + ("action",)),
    _m("trainwatch_run_supervisor_stopped", "gauge",
       "1 while the run's journal says its supervisor (trainwatch run) stopped it after its "
       "last start (controller_stopped), or a person closed it (run_closed, trainwatch "
       "close: its job is gone): ranks killed by that stop are not down; 0 otherwise.",
       RUN_NODE),
    _m("trainwatch_run_supervisor_up", "gauge",
       "1 while the run's supervisor (trainwatch run, alerts receive with a job) runs on this "
       "node and beats; 0 when it is frozen (stopped, T), dead (gone, zombie) or hung (its "
       "heartbeat older than 20 s while it uses no CPU, or 120 s while it spins). Only the "
       "agent on its host exports it, only for a supervisor that writes a heartbeat, and not "
       "after it stopped cleanly.",
       RUN_NODE),
    _m("trainwatch_run_supervisor_heartbeat_age_seconds", "gauge",
       "Seconds since the run's supervisor last wrote its heartbeat (RUN_DIR/supervisor.beat, "
       "every second), as the agent on its host reads it.",
       RUN_NODE, "seconds"),
    # The job-wide view, from the run's own record (run.json, its ranks' statuses) in the
    # run directory every node's agent reads (agent/jobview.py): on shared storage each
    # agent sees every node's ranks, so a lost node is named by the agents that remain.
    _m("trainwatch_run_ranks_expected", "gauge",
       "Ranks the run expects: the world size its record declares (run.json, else its "
       "ranks' statuses), the same from every agent that reads the run's directory.",
       RUN_NODE),
    _m("trainwatch_run_ranks_reporting", "gauge",
       "Ranks of the run, on any node, whose status this agent saw written within "
       "stall.heartbeat_stale_seconds, or that finished or stopped cleanly: the whole job's "
       "where the run directory is shared, this node's where it is not.", RUN_NODE),
    _m("trainwatch_run_node_silent_seconds", "gauge",
       "Present while a node the run's rank statuses name stopped reporting (none of its "
       "ranks wrote a status within stall.heartbeat_stale_seconds, and not all finished or "
       "stopped): seconds since the newest of them was seen written. node is the silent node "
       "(every agent reading the run's directory exports it; instance tells them apart).",
       RUN_NODE, "seconds"),
    _m("trainwatch_train_restarts_total", "counter",
       "Restarts of the job's ranks, by kind: torchrun (restarted events) or controller (the "
       "controller starting the job again, job_started after the first attempt).",
       RUN_NODE + ("kind",)),
    _m("trainwatch_checkpoint_last_save_duration_seconds", "gauge",
       "Seconds the newest checkpoint save took to write and fsync its files (in the "
       "background in async mode); absent before the first save.", RUN_NODE, "seconds"),
    _m("trainwatch_checkpoint_last_blocking_seconds", "gauge",
       "Seconds the newest checkpoint save blocked the training loop; absent before the "
       "first save.", RUN_NODE, "seconds"),
    _m("trainwatch_checkpoint_saves_total", "counter",
       "Verified checkpoint saves of the run (the most any of the node's ranks counted; "
       "resets when the job restarts).", RUN_NODE),
    _m("trainwatch_train_nonfinite_skipped_steps_total", "counter",
       "Steps the checkpoint library's non-finite guard skipped (or halted on) because a "
       "rank's loss or gradient was NaN or Inf (resets when the job restarts).", RUN_NODE),
]

# --- cost and goodput (`trainwatch report --prom-textfile`, branch `report`) -----------
# Written per run by the report into a node_exporter textfile, not by the agent. Money is
# left to PromQL (accelerator seconds x price), so no currency sits in a metric name.
_SPECS += [
    _m("trainwatch_cost_goodput_ratio", "gauge",
       "Productive step time of surviving steps divided by the run's wall time (0-1).", RUN,
       "ratio"),
    _m("trainwatch_cost_effective_training_time_ratio", "gauge",
       "Time in surviving steps, data wait included, divided by the wall time (0-1).", RUN,
       "ratio"),
    _m("trainwatch_cost_wall_seconds", "gauge",
       "Wall time the run held its accelerators (its span minus time no launcher ran).", RUN,
       "seconds"),
    _m("trainwatch_cost_productive_seconds", "gauge",
       "Wall time spent in surviving steps, data wait excluded.", RUN, "seconds"),
    _m("trainwatch_cost_badput_seconds", "gauge",
       "Wall time lost, by category (data_wait, recomputed, restart_downtime, "
       "initial_startup, checkpoint, evaluation, stalled, shutdown, other).", RUN + ("category",),
       "seconds"),
    _m("trainwatch_cost_accelerators", "gauge",
       "Accelerators the report bills the run for.", RUN),
    _m("trainwatch_cost_incidents", "gauge",
       "Interruptions (ends of attempts that did not finish the run) in the report.", RUN),
    _m("trainwatch_cost_recomputed_steps", "gauge",
       "Step executions whose work a restart or rollback threw away.", RUN),
    _m("trainwatch_cost_productive_tokens", "gauge",
       "Tokens trained by the surviving steps, job-wide.", RUN),
]

# --- replica divergence: silent data corruption (agent collector `replicas`, docs/sdc.md).
# Ranks of one replica group hold the same parameters; each publishes a digest of them
# every N steps and the agent compares the digests of one step across the ranks it sees.
REPLICA_GROUP = RUN_NODE + ("group",)
_SPECS += [
    _m("trainwatch_replica_divergence_digests", "gauge",
       "Consecutive compared digests of the replica group in which the same ranks "
       "(suspects: '3', or 'one of 0,1' without a majority) disagreed; absent while all agree.",
       REPLICA_GROUP + ("suspects",)),
    _m("trainwatch_replica_digest_mismatch", "gauge",
       "Consecutive compared digests in which the rank's parameters differed from its replica "
       "group's majority (0: agrees, or no majority to differ from).", RUN_RANK),
    _m("trainwatch_replica_digest_step", "gauge",
       "Newest step whose digests the agent compared across the group's ranks.", REPLICA_GROUP),
    _m("trainwatch_replica_digest_ranks_compared", "gauge",
       "Ranks whose digests of the newest compared step the agent compared.", REPLICA_GROUP),
    _m("trainwatch_replica_digest_ranks_agreeing", "gauge",
       "Ranks in the strict majority of the newest compared step (0: none).", REPLICA_GROUP),
    _m("trainwatch_replica_digest_value", "gauge",
       "The low 52 bits of the rank's newest parameter digest (exact in a float), to compare "
       "replicas across nodes in PromQL.", RUN_RANK + ("group",)),
    _m("trainwatch_replica_digest_value_step", "gauge",
       "The step of the rank's newest parameter digest (trainwatch_replica_digest_value).",
       RUN_RANK + ("group",)),
]

# --- reduction checksum: silent data corruption in the all-reduce (Telemetry.check_reduction,
# docs/sdc.md). Each rank checks, every N steps, that DDP's reduced gradient sums to what
# the ranks sent; a mismatch is counted in its status.
_SPECS += [
    _m("trainwatch_rank_reduction_checksum_mismatches_total", "counter",
       "Gradient buckets whose all-reduced sum differed from the sum of the ranks' local "
       "sums by more than float rounding (a wrong reduction on some GPU or link).", RUN_RANK),
    _m("trainwatch_rank_reduction_checksum_last_mismatch_timestamp_seconds", "gauge",
       "Unix time the rank last found a reduction checksum mismatch; absent if none.",
       RUN_RANK, "seconds"),
]

METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}


# A rank's status fields that become series one to one, read by both exporters of a rank's
# status (the agent's ranks collector and the rank's own metrics server), so the two cannot
# export a field under different names. Latest step record ("metrics") field -> gauge:
STEP_FIELD_METRICS = {
    "loss": "trainwatch_train_loss",
    "grad_norm": "trainwatch_train_grad_norm",
    "lr": "trainwatch_train_learning_rate",
    "tokens_per_second": "trainwatch_train_tokens_per_second",
    "samples_per_second": "trainwatch_train_samples_per_second",
    "mfu": "trainwatch_train_mfu_ratio",
    "step_time_seconds": "trainwatch_rank_step_time_seconds",
    "data_wait_seconds": "trainwatch_rank_data_wait_seconds",
    "memory_bytes": "trainwatch_rank_memory_bytes",
}
# Status "counters" field -> counter:
COUNTER_FIELD_METRICS = {
    "steps_total": "trainwatch_rank_steps_total",
    "nonfinite_loss_total": "trainwatch_train_nonfinite_loss_total",
    "nonfinite_grad_norm_total": "trainwatch_train_nonfinite_grad_norm_total",
    "telemetry_errors_total": "trainwatch_rank_telemetry_errors_total",
    "reduction_mismatches_total": "trainwatch_rank_reduction_checksum_mismatches_total",
}
# Top-level status field -> gauge:
STATUS_FIELD_METRICS = {
    "step": "trainwatch_rank_step",
    "restart_count": "trainwatch_rank_restarts",
    "last_nonfinite_loss_at": "trainwatch_train_last_nonfinite_loss_timestamp_seconds",
    "last_reduction_mismatch_at":
        "trainwatch_rank_reduction_checksum_last_mismatch_timestamp_seconds",
}
# Status "eval" field -> gauge:
EVAL_FIELD_METRICS = {"val_loss": "trainwatch_train_validation_loss"}
# The step record's {phase: seconds} -> one gauge per phase (label ``phase``):
PHASE_SECONDS_FIELD = "phase_seconds"
PHASE_TIME_METRIC = "trainwatch_rank_phase_time_seconds"
