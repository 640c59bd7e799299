"""Ranks & stragglers: which rank is slow or stuck, and what its process is doing."""

from __future__ import annotations

from trainwatch.contract.states import PROCESS_STATES, RANK_STATES
from trainwatch.dashboards.panels import Board, flags, states, target

RANK_STATE_COLORS = {"running": "green", "finished": "blue", "failed": "red",
                     "stopped": "orange"}
PROCESS_STATE_COLORS = {"running": "green", "sleeping": "blue", "disk_sleep": "orange",
                        "stopped": "red", "zombie": "dark-red", "gone": "text",
                        "unknown": "text"}
RANK = "rank {{rank}}"


def build(runbook_base: str, limits: dict) -> dict:
    b = Board("ranks-stragglers", "trainwatch / Ranks & stragglers",
              "Per-rank timing, straggler scores, stall findings and the ranks' processes.",
              ("run", "node", "rank"), runbook_base)

    b.row("Timing")
    b.timeseries("Step time", target(b.sel("trainwatch_rank_step_time_seconds"), RANK),
                 unit="s", description="Wall time of each rank's last step; in a healthy "
                                       "job all ranks are equal (collectives sync them).")
    b.timeseries("Local time", target(b.sel("trainwatch_rank_local_seconds"), RANK),
                 unit="s", description="Mean time per step outside collectives over the last "
                                       "timing window: the rank's own speed, what straggler "
                                       "detection compares.")
    b.timeseries("Progress age", target(b.sel("trainwatch_rank_progress_age_seconds"), RANK),
                 unit="s", description="Since the rank last completed a step.",
                 alerts=("TrainingStalled",))

    b.row("Stragglers")
    b.timeseries("Time ratio to the job median",
                 target(b.sel("trainwatch_straggler_time_ratio"), RANK),
                 unit="none", limit=limits["straggler_rank_ratio"],
                 description="Rank's local time / job median (1 = typical, 1.25 = 0.8x speed).",
                 alerts=("TrainingStragglerRank",))
    b.timeseries("Straggler score", target(b.sel("trainwatch_straggler_score"), RANK),
                 description="Robust z-score of the rank's local time against the job "
                             "(median/MAD); large positive = slower than the rest.")
    b.timeseries("Node time ratio",
                 target(b.sel("trainwatch_straggler_node_time_ratio"), "{{node}}"),
                 unit="none", limit=limits["straggler_node_ratio"],
                 description="Median local time of a node's ranks / job median.",
                 alerts=("TrainingStragglerNode",))
    b.state_timeline("Straggler flags",
                     target(b.sel("trainwatch_straggler_active"), RANK),
                     target(b.sel("trainwatch_straggler_node_active"), "node {{node}}"),
                     mappings=flags("ok", "straggler", "orange"),
                     description="While a rank (or a whole node) is flagged as a straggler.",
                     alerts=("TrainingStragglerRank", "TrainingStragglerNode"))
    b.timeseries("Slow windows", target(b.sel("trainwatch_straggler_slow_windows"), RANK),
                 description="Consecutive timing windows in which the rank was slow.", w=6)
    b.table("Flagged stragglers and likely cause",
            target(f"{b.sel('trainwatch_straggler_info')} == 1", table=True),
            description="The likely cause from node evidence: gpu_thermal, gpu_power, "
                        "gpu_throttle, cpu_contention, storage, data_wait, network_errors or unknown.",
            alerts=("TrainingStragglerRank",), w=6)

    b.row("Stalls")
    b.state_timeline("Stalled", target(b.sel("trainwatch_rank_stalled"), RANK),
                     mappings=flags("progressing", "stalled"),
                     description="While the rank's step has not advanced within its budget.",
                     alerts=("TrainingStalled",))
    b.timeseries("Stall time and budget",
                 target(b.sel("trainwatch_rank_stall_seconds"), "stalled rank {{rank}}"),
                 target(b.sel("trainwatch_rank_stall_budget_seconds"), "budget rank {{rank}}"),
                 unit="s", description="How long a stalled rank has made no progress, against "
                                       "the budget applied to it.", alerts=("TrainingStalled",),
                 w=12)
    b.table("Stall incident: culprit", target(
        f"{b.sel('trainwatch_stall_incident_seconds')}", table=True),
            description="One incident per job and node: the rank the node's agent blames "
                        "(dead, frozen, busy, or stuck outside the collective the others wait in; "
                        "unknown when all its stalled ranks wait alike), its stall kind and "
                        "for how long. TrainingStalled fires once per incident.",
            alerts=("TrainingStalled",), w=6)
    b.timeseries("Stall incident: ranks by role",
                 target(f"sum by (role) ({b.sel('trainwatch_stall_incident_ranks')})", "{{role}}"),
                 description="Ranks in the open stall incident: the culprit(s), and the ranks "
                             "waiting for them.", alerts=("TrainingStalled",), w=6)
    b.table("Stall findings", target(f"{b.sel('trainwatch_rank_stall_info')} == 1", table=True),
            description="kind: stuck (alive, heartbeat fresh: waiting on something), busy "
                        "(process runnable and burning CPU outside a collective phase: C code "
                        "holding the GIL, heartbeat stale, or a spin in Python, heartbeat "
                        "fresh), frozen (heartbeat stale or process stopped) or dead; phase: "
                        "where it stalled. `trainwatch diagnose` names the culprit.",
            alerts=("TrainingStalled",))
    b.timeseries("Stalls detected",
                 target(f"sum by (rank, kind) ({b.increase('trainwatch_rank_stalls_total')})",
                        "rank {{rank}} {{kind}}"),
                 description="Stalls the agent detected, by kind.", w=12)

    b.row("Processes")
    b.state_timeline("Rank state",
                     target(b.enum("trainwatch_rank_state", "state", RANK_STATES, "run, rank"),
                            RANK),
                     mappings=states(RANK_STATES, RANK_STATE_COLORS),
                     description="Lifecycle state the rank reports.",
                     alerts=("TrainingRankDown",))
    b.state_timeline("Process state",
                     target(b.enum("trainwatch_process_state", "state", PROCESS_STATES,
                                   "run, rank"), RANK),
                     mappings=states(PROCESS_STATES, PROCESS_STATE_COLORS),
                     description="OS state of the rank's process: disk_sleep (D) hangs on "
                                 "I/O, stopped is SIGSTOPped, gone has exited.",
                     alerts=("TrainingRankDown",))
    b.timeseries("Process CPU", target(b.rate("trainwatch_process_cpu_seconds_total"), RANK),
                 unit="percentunit",
                 description="CPU time per second of the rank's process (1 = one core).")
    b.timeseries("CPU contention",
                 target(b.sel("trainwatch_process_cpu_contention_ratio"), RANK),
                 unit="percentunit", min_=0, max_=1,
                 description="Share of the CPU on the rank's allowed cores that other "
                             "processes used.")
    b.timeseries("Process memory (RSS)",
                 target(b.sel("trainwatch_process_resident_memory_bytes"), RANK),
                 unit="bytes", description="Resident set size of the rank's process.")
    b.timeseries("Rank memory", target(b.sel("trainwatch_rank_memory_bytes"), RANK),
                 target(b.sel("trainwatch_gpu_process_memory_bytes"), "GPU {{gpu}} rank {{rank}}"),
                 unit="bytes", description="The rank's reported peak (CUDA allocated on GPU, "
                                           "RSS on CPU) and the GPU memory NVML sees for its "
                                           "process.")
    b.timeseries("Threads", target(b.sel("trainwatch_process_threads"), RANK),
                 description="Threads in the rank's process.")
    b.table("Ranks", target(f"{b.sel('trainwatch_rank_info')} == 1", table=True),
            description="Process-group backend and torch device of each rank.", w=8)
    return b.to_json()
