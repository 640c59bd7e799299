"""The enumerations files and metrics carry: phases, rank, process and collector states.

Status files, metric labels, dashboards and diagnose all speak these words; they are
defined here once, torch-free, so the agent and the dashboards need not import the
trainer to know them.
"""

from __future__ import annotations

# Phases a rank's status names (docs/run-directory.md). Tools know budgets and colours for
# these; any other name a user's loop sets is accepted and shown as is.
STEP_PHASE, EVAL_PHASE = "step", "eval"
KNOWN_PHASES = ("init", STEP_PHASE, "data", "forward", "backward", "optimizer", EVAL_PHASE,
                "checkpoint", "telemetry_exchange", "idle", "finished")

# Phases in which a rank waits for its peers (the trainer telemetry's collective phases, and
# the names hand-written loops use for their collectives): a stalled rank in one of these
# waits for another; one outside them is where the others wait for.
COLLECTIVE_PHASES = frozenset({
    "backward", "telemetry_exchange", "allreduce", "all_reduce", "allgather", "all_gather",
    "reduce_scatter", "broadcast", "barrier", "collective", "sync"})

# A rank's ``state`` in its status file.
RUNNING, FINISHED, FAILED, STOPPED = "running", "finished", "failed", "stopped"
RANK_STATES = (RUNNING, FINISHED, FAILED, STOPPED)
# A failed rank's ``failure.kind`` when it died on bad input (a ConfigError): restarting
# it cannot help, so the supervisor ends the run with exit 2 instead.
BAD_INPUT = "bad_input"
# ... when any other error nothing caught ended it (a bug in the loop, a peer's failure seen
# from a collective): a crash, restarted like any other.
ERROR = "error"

# A rank process as the host sees it (``trainwatch_process_state``'s ``state`` label).
PROCESS_STATES = ("running", "sleeping", "disk_sleep", "stopped", "zombie", "gone", "unknown")

# The kinds of stall the agent tells apart (``trainwatch_rank_stall_info``'s ``kind``).
STALL_KINDS = ("stuck", "busy", "frozen", "dead")

# An agent collector's state (``trainwatch_collector_state``'s ``state`` label).
COLLECTOR_STATES = ("ok", "failed", "timeout", "absent", "pending", "disabled")
